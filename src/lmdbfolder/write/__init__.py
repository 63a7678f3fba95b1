"""The write side: sample lists, source files into records, the writer, shards.

Every pack call (``pack``, ``pack_sharded``, ``pack_ray``, ``dry_run``, the CLI)
is one ``PackRequest`` that ``planner.plan`` turns into a ``Plan``, run by one
executor (``executors.EXECUTORS``: ``writer``, ``shards``, ``ray``, ``dryrun``).
``writer`` holds the entry points (``pack``, ``pack_sources``); the work is
done, in order, by ``sources`` (``SourceSpec.scan``), ``sizing`` (``plan``),
``resume`` and ``output`` (is it written already, may it resume, the output
directory), ``loop`` (batched, checkpointed commits fed by ``records``
through ``processes`` or ``threads``) and ``runtime`` (process settings for
the run). ``shards`` and ``ray`` build sharded packs from the same writer.
Names with a leading underscore are shared by these modules only.

It imports only the core (``format``, ``errors``, ``encodings``, ``progress``,
``packfile``, ``packdir``) and never the read side or the tools.
"""
