"""radix_ext inside SGLang's own server: the out-of-tree CPU platform, the
`session` radix-cache backend and the control channel that reaches it.

Entry points (pyproject.toml):
- `sglang.srt.platforms`: `session_cpu = radix_ext.sglang.platform:activate`
- `sglang.srt.plugins`: `session_runtime = radix_ext.sglang.plugin:register`

Nothing here imports HTTP or the runtime's conversation layer.
"""
