"""The patch series as package data (``dflash.patch_series``), read by ``dflash.patching.series``.

setup.py maps this folder to that package so the import hook, the wheel builder and the PR kit
read the same files in regular and editable installs. See README.md here for the format.
"""
