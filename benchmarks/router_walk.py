"""A completion's way through the router: its back-and-forths between steps (issue 30, point 4).

    .venv/bin/python benchmarks/router_walk.py [--stream] [--chat | --tools]

One /v1/completions (or /v1/chat/completions) request, max_tokens 4, is sent to a router on a
scripted stage 0 (tests/router_support.py: real gRPC, real uvicorn, the demo model's tokenizer);
`sys.settrace` follows the router's thread from the conductor's first call (`Router.completions` /
`Router.chat`) until the response has been sent.

Two figures (tests/router_way_support.py holds the tracer, the step of each module and the
definitions, which docs/architecture.md repeats):

* back-and-forths, the issue's measure: the way is the sequence of steps (parse, validate, plan,
  pick, stream, format) entered by calls; calls into edge modules (the conductor, the HTTP edge,
  errors, metrics, traces) are transparent and returns to the conductor are not back-and-forths. A
  back-and-forth is the way entering a step earlier than one already reached (each distinct
  (left, entered) module pair once: a per-token loop counts once), or a call anywhere from a
  module of a later step into a module of an earlier one (a callback). Goal: <= 5.
* strict: every return to any router module already left (helpers included, repeats merged),
  as the first version of this script counted it; a conductor calling steps in turn cannot reach
  5 by this count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from router_way_support import measure, strict_returns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stream", action="store_true", help="a streamed request")
    ap.add_argument("--chat", action="store_true", help="a chat completion instead")
    ap.add_argument("--tools", action="store_true", help="chat with a tool, the hermes tool-call parser")
    args = ap.parse_args()
    way = measure(args.stream, args.chat or args.tools, tools=args.tools)
    kind = "chat with tools" if args.tools else "chat" if args.chat else "completion"
    print(f"{kind} (stream={args.stream}): {len(way.modules)} module steps")
    print(f"strict: returns to a module already left: {strict_returns(way.modules)}")
    both = way.back_and_forths()
    print(f"back-and-forths (distinct step pairs): {len(both)}: {sorted(both)}")
    print(f"  the way entering an earlier step: {way.entries} times, module pairs: {sorted(way.back)}")
    print(f"  callbacks, module pairs: {sorted(way.callbacks)}")
    print("steps:", " > ".join(way.steps()))
    print("way:", " > ".join(way.way))
    print("walk:", " > ".join(way.modules))


if __name__ == "__main__":
    main()
