"""Make the pass-test helpers (``passgraphs.py``) importable whatever pytest's import mode is."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
