"""Tools on finished packs: info, verify, copy, the page cache, importing recipe LMDBs.

They may use both the read and the write side; nothing below imports them.
"""
