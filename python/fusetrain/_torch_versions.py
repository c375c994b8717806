"""The torch releases fusetrain supports, in one place.

setup.py, CMakeLists.txt and scripts/install-deps.sh read this file as text
(it is imported by none of them, since it must be readable before anything is
built): keep it to these three assignments of string literals.
"""

OLDEST = "2.11"  # the GPU box ships torch 2.11.0 (cu130)
NEWEST = "2.15"
DEFAULT = "2.15.0"  # what scripts/install-deps.sh puts in .venv
