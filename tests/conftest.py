"""Shared by every test file."""
import os

# train.py and decode.py keep compiled programs in ~/.cache/seq2seq/jax; tests (and the
# scripts they start) leave the home directory alone. test_decode_cli turns it on in a
# temporary directory to test it.
os.environ.setdefault("SEQ2SEQ_COMPILE_CACHE", "off")
