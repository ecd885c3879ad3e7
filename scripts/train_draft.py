"""CLI wrapper: self-distil a chain MTP draft for the default target (see mleagle.engine.spec.train).

Example: `.venv/bin/python scripts/train_draft.py --num-seqs 288 --steps 90 --out results/drafts/smollm2-mtp2`.
"""

from __future__ import annotations

from mleagle.engine.spec.train import main

if __name__ == "__main__":
    raise SystemExit(main())
