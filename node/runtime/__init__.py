"""Process plumbing every role uses: supervised asyncio tasks with a bounded shutdown (supervisor.py),
durable writes (durable.py) and logging (logs.py)."""
