"""The runtime (core.py's `Runtime`) and its parts, each a class built with
what it uses:

- conversation_table.py: the conversations and their locks;
- request_checks.py: what a request is refused for, before anything changes;
- stateless.py: a stateless request's conversation (inference.py's index);
- chat_history.py: a chat client's history against the stored conversation;
- step_path.py: render, one backend request, commit in every layer;
- turn_close.py: a turn's close, the reasoning policy (policy auto too);
- inspection.py: read-only views;
- and ../store/persistence.py: the store.

May import the core modules, the backends' interface (backends/base.py and
create_backend), the store and the templates; never the API or the CLI.
"""

from session_runtime.runtime.core import Runtime

__all__ = ["Runtime"]
