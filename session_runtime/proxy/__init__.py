"""The way out to a provider's API: its HTTP client (client.py), the outbound
stripper and its accounting (outbound.py), and a conversation's trace as that
provider's request body (transcript.py).

May import the protocols, the templates and the core helpers (accounting,
direct_http, sequences); never the runtime, the backends, the API or the CLI.
"""
