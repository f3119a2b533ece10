"""The reference backend: the readable PyTorch definition of the ABI in docs/abi.md."""
