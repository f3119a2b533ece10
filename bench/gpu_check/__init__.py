"""The one-shot GPU check: `python -m bench.gpu_check OUT_DIR` (or `--cpu-smoke`).

A GPU is lent only now and then, for minutes; this one prepared command turns those minutes into
evidence: build the CUDA backend, run the conformance suite natively on every backend, measure the
device's copy bandwidth and matmul rate, benchmark the headline shapes on every fast backend next
to torch's scaled_dot_product_attention (and FlexAttention where torch has it), time the CUDA
planner's opt-in settings next to its defaults and apply the rule that picks the defaults
(cuda/paged_cuda/tune_verdict.py), check those settings' conformance and the CUDA-graph
capture, and write a markdown report and JSON whose last lines are a short table and the rule's
verdict.
"""
