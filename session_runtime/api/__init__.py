"""The HTTP edge: a thin FastAPI shell over Runtime.

May import everything below it (the runtime, the protocols, the backends'
interface); nothing imports it but the CLI.
"""
