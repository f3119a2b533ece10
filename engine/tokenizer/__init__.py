"""Text <-> token ids for the engine: the `Tokenizer` of one model, its chat template and the
per-request incremental detokenizer.

Modules: `tokenizer` (the `Tokenizer` facade), `gguf_vocab` (a GGUF's `tokenizer.ggml.*`
metadata -> a BPE tokenizer), `hf_dir` (a Hugging Face directory's tokenizer files),
`chat_template` (rendering chat templates), `detokenizer` (incremental detokenising).
"""

from engine.tokenizer.chat_template import render_chat_template
from engine.tokenizer.detokenizer import IncrementalDetokenizer
from engine.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "render_chat_template"]
