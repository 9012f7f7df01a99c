"""Where conversations are kept: the stores and what they keep.

- sqlite.py: the SQLite store (one file under --data-dir): a conversation as
  rows per step, its index read at start, a conversation read at first use;
- pg.py: the same over PostgreSQL (--store), for several processes;
- rows.py, delta.py: a conversation's rows, and what a step adds to them;
- registry.py: the conversations a runtime serves, the recent ones in memory;
- persistence.py: the runtime's part over all of it (opening the store,
  each step's write, parking and reading back, placement on workers);
- fleet.py: several runtime processes over one PostgreSQL store: membership,
  ownership, takeover.

May import the core (conversation, offload settings, inference's digests,
errors); nothing here imports the runtime, the backends' internals, the API
or the CLI.
"""
