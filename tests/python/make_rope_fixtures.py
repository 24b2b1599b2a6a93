"""Writes tests/python/fixtures/rope_tables.pt: transformers' RoPE tables at
a few positions per scheme, so CI checks attnprep.rope_cos_sin_cache against
them without transformers installed.

    python tests/python/make_rope_fixtures.py      (needs transformers)
"""

import os

import torch
import transformers
from rope_schemes import POSITIONS, SCHEMES, transformers_table

here = os.path.dirname(os.path.abspath(__file__))
tables = {name: transformers_table(name)[POSITIONS].clone() for name in SCHEMES}
torch.save(
    {"transformers": transformers.__version__, "positions": POSITIONS, "tables": tables},
    os.path.join(here, "fixtures", "rope_tables.pt"),
)
print(f"wrote {len(tables)} tables from transformers {transformers.__version__}")
