"""The read side: open finished packs (single or sharded), decode what they hold.

It imports only the core (``format``, ``errors``, ``encodings``,
``packfile``, ``packdir``) and never the write side or the tools.
"""
