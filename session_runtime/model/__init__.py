"""A Qwen3/Llama-family decoder that keeps its KV in SGLang's pool.

May import the config and the errors only.
"""
