"""Integrations with other libraries. Each submodule imports its library only when one of its functions runs,
so that `import sparse_flash` (and importing these modules) needs torch alone.

- `sparse_flash.integrations.transformers`: an `attn_implementation` for Hugging Face transformers >= 5.
"""
