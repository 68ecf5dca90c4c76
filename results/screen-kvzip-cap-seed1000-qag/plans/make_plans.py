"""The shipped adaptive KVzip plan with its per-prompt split capped at `cap` x each layer's budget
("allocation_cap"), nothing else changed."""
import json
from pathlib import Path

here = Path(__file__).parent
src = Path(__file__).parents[3] / "plans" / "qwen2.5-coder-0.5b-instruct-q4_k_m.kvzip-prompt-adaptive.b128.json"
for cap in (2, 4, 8):
    d = json.loads(src.read_text())
    d["allocation_cap"] = cap
    d["provenance"]["extra"]["note"] = (f"{src.name} with \"allocation_cap\": {cap} (a layer keeps at most {cap} x its "
                                        "budget of the per-prompt split); screened on calibration prompts (seed 1000)")
    (here / f"kvzip-ada-cap{cap}.b128.json").write_text(json.dumps(d, indent=1) + "\n")
