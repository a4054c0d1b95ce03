"""sglang-gateway: a request gateway in front of SGLang inference servers."""
