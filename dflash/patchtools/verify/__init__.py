"""Two-thread checks of the torch.compile / FX thread-safety bug classes (:data:`.catalogue.BUG_CLASSES`).

- :mod:`.catalogue`: the classes, and which torch releases have each (``docs/bug-classes.md``);
- :mod:`.workloads`: the compiled functions, traces and steps the checks race;
- :mod:`.checks`: one check per class, run in this interpreter;
- :mod:`.cold_start`: class K's race of a fresh process's first calls, in a child interpreter;
- :mod:`.runner`: fresh-interpreter runs plain vs patched, and the command line;
- :mod:`.records`: the verification records ``--record`` writes (:mod:`dflash.patching.records` reads them).

Needs only torch and :mod:`dflash.compile_watch` (no transformers), so it also runs against a
rebuilt torch wheel with the repository on ``PYTHONPATH`` and no dflash installed.
"""
