"""The write side: sample lists, source files into records, the writer, shards.

It imports only the core (``format``, ``errors``, ``codecs``, ``progress``,
``environments``, ``packdir``) and never the read side or the tools.
"""
