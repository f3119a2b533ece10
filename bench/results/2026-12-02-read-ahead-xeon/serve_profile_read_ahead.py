import sys, cpu_impl.backend as cb
cb.read_ahead = sys.argv[1] == "1"
sys.argv = ["serve_profile", "--batch", "16", "--threads", "2", "--steps", "20"]  # fixed settings
from bench import serve_profile
serve_profile.main()
