"""`bench.serve_profile --batch 16 --threads 2 --steps 20` with the cpu backend's decode
read-ahead set by the argument: 1 on, 0 off (run with PYTHONPATH at the repository root)."""

import sys

import cpu_impl.backend as cpu_backend
from bench import serve_profile

if __name__ == "__main__":
    cpu_backend.read_ahead = sys.argv[1] == "1"
    sys.argv = ["serve_profile", "--batch", "16", "--threads", "2", "--steps", "20"]
    serve_profile.main()
