"""`python tests/faulty_serve.py ARGS`: `python -m engine.serve ARGS` whose engine fails one
model step on demand, for tests/test_serve_engine_faults.py.

When the file named by $FAULTY_SERVE_TRIGGER exists, the next `LLMEngine.execute_step` (after
the scheduler has allocated the step's KV blocks, before the model runs) removes it and raises:
a RuntimeError if the file says "exception", else `InjectedFault`, a BaseException, which ends
the engine thread.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import serve  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402


class InjectedFault(BaseException):
    """A fault that is not an Exception."""


def _inject(execute_step):
    trigger = os.environ["FAULTY_SERVE_TRIGGER"]

    def faulty(self, out):
        if os.path.exists(trigger):
            with open(trigger) as f:
                kind = f.read().strip()
            os.unlink(trigger)
            if kind == "exception":
                raise RuntimeError("injected fault")
            raise InjectedFault("injected fault")
        return execute_step(self, out)

    return faulty


if __name__ == "__main__":
    LLMEngine.execute_step = _inject(LLMEngine.execute_step)
    sys.exit(serve.main())
