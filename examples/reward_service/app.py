"""A small reward service that rlmesh can call by URL (the HTTP JSON protocol).

It scores each sample against its label and returns two named scores:
"exact" (1.0 when the response equals the label, ignoring surrounding spaces and
case) and "similarity" (difflib's ratio, 0..1). A run uses them as reward
components "<registered name>/exact" and "<registered name>/similarity".

    uvicorn app:app --port 8000          # from this directory, or:
    python examples/reward_service/app.py --port 8000

Then register it (see README.md) and name it in a run's reward components.
"""

import argparse
import asyncio
import difflib
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel

app = FastAPI(title="example reward service")
samples_scored = 0  # how many samples this process has scored (GET /stats)


class ScoreRequest(BaseModel):
    samples: list[dict[str, Any]]  # rlmesh's JSON samples: response, label, prompt, metadata, ...


class ScoreResponse(BaseModel):
    scores: list[float | dict[str, float] | None]  # one per sample, in order


def score(sample: dict[str, Any]) -> dict[str, float] | None:
    response, label = sample.get("response", "").strip(), sample.get("label", "").strip()
    if not label:
        return None  # null: "cannot score this one" (rlmesh marks the sample FAILED, it is never a silent 0)
    return {
        "exact": float(response.casefold() == label.casefold()),
        "similarity": difflib.SequenceMatcher(None, response, label).ratio(),
    }


@app.post("/score")
def score_batch(request: ScoreRequest) -> ScoreResponse:
    global samples_scored
    samples_scored += len(request.samples)
    return ScoreResponse(scores=[score(s) for s in request.samples])


@app.get("/stats")
def stats() -> dict[str, int]:
    return {"samples_scored": samples_scored}


async def start(host: str = "127.0.0.1", port: int = 0) -> tuple[uvicorn.Server, int]:
    """Serve in the running event loop; returns the server and its bound port."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    serving = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if serving.done():  # e.g. the port is taken
            raise RuntimeError(f"the example reward service did not start on {host}:{port}")
        await asyncio.sleep(0.02)
    return server, server.servers[0].sockets[0].getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
