import os
import pathlib

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
