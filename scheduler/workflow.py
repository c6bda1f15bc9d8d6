"""Agent workflows (KVFlow): cached prefixes ranked by steps-to-execution.

Agent frameworks run a fixed cast of agents in an order they know in advance;
LRU evicts exactly the prefix that runs next. A client tells kvreel, through a
request's ``kv_transfer_params``, which workflow and agent the request belongs
to and (once per workflow) the workflow's step graph::

    {"kvreel": {"workflow": "review-7", "agent": "coder", "step": 3,
                "graph": {"planner": ["coder"], "coder": ["critic"], "critic": ["planner"]}}}

``graph`` maps each agent to the agents that may run right after it (loops
allowed). kvreel then knows, for every agent, how many steps away its next run
is: 0 while it runs, the length of the shortest path from the agent running
(or last run) otherwise. A cached chunk takes the nearest distance of the
agents that used it; the host and disk tiers evict the furthest first (LRU
among equals), and the connector prefetches the chunks of agents at most
``KVREEL_PREFETCH_DEPTH`` steps away from disk or the remote store into host
memory.

Hints only move chunks between tiers; they never change what is computed.
Malformed or absurd hints are ignored with a log line. ``Workflow`` (below) is
the client-side helper that builds them.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from typing import Any

logger = logging.getLogger(__name__)

HINTS_KEY = "kvreel"
MAX_AGENTS = 256
MAX_EDGES = 4096
MAX_NAME = 128
MAX_WORKFLOWS = 1024          # the least recently hinted workflow is forgotten beyond this
FAR = math.inf                # no known next run (no hints, or not reachable)


class HintError(ValueError):
    """A request's workflow hints are malformed, unknown or absurd."""


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise HintError(f"{what} must be a string of 1-{MAX_NAME} characters")
    return value


def parse_graph(graph: Any) -> dict[str, tuple[str, ...]]:
    """A step graph ``{agent: [next agents]}``, validated and bounded."""
    if not isinstance(graph, dict) or not 0 < len(graph) <= MAX_AGENTS:
        raise HintError(f"graph must map 1-{MAX_AGENTS} agents to their successors")
    out: dict[str, tuple[str, ...]] = {}
    edges = 0
    for agent, nexts in graph.items():
        if not isinstance(nexts, (list, tuple)):
            raise HintError(f"graph[{agent!r}] must be a list of agents")
        out[_name(agent, "an agent")] = tuple(dict.fromkeys(_name(n, "an agent") for n in nexts))
        edges += len(nexts)
    if edges > MAX_EDGES:
        raise HintError(f"graph has {edges} edges (at most {MAX_EDGES})")
    unknown = {n for nexts in out.values() for n in nexts} - out.keys()
    if unknown:
        raise HintError(f"graph names agents it does not define: {sorted(unknown)[:5]}")
    return out


class _Run:
    """One workflow: its graph, where it stands, and the distances from there."""

    __slots__ = ("graph", "agent", "running", "step", "_dist")

    def __init__(self, graph: dict[str, tuple[str, ...]]):
        self.graph = graph
        self.agent: str | None = None
        self.running = False
        self.step = -1
        self._dist: dict[str, int] | None = None

    def distances(self) -> dict[str, int]:
        """Steps until each reachable agent runs next (BFS over the graph)."""
        if self._dist is None:
            if self.agent is None:
                self._dist = {}
            else:
                dist = {self.agent: 0} if self.running else {}
                todo = deque((n, 1) for n in self.graph[self.agent])
                while todo:
                    agent, d = todo.popleft()
                    if agent in dist:
                        continue
                    dist[agent] = d
                    todo.extend((n, d + 1) for n in self.graph[agent] if n not in dist)
                self._dist = dist
        return self._dist


class WorkflowTracker:
    """Scheduler side: the workflows clients described, the agent each request
    runs for, and the distance of every (workflow, agent) to its next run."""

    def __init__(self) -> None:
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._requests: dict[str, tuple[str, str]] = {}
        self.ignored = 0

    def on_request(self, req_id: str, params: Any) -> tuple[str, str] | None:
        """Read a new request's hints (``kv_transfer_params``); its (workflow,
        agent), or None without hints or with bad ones (logged, ignored)."""
        if req_id in self._requests:
            return self._requests[req_id]
        hints = params.get(HINTS_KEY) if isinstance(params, dict) else None
        if hints is None:
            return None
        try:
            tag = self._apply(req_id, hints)
        except HintError as e:
            self.ignored += 1
            logger.warning("kvreel: ignoring the workflow hints of request %s: %s", req_id, e)
            return None
        self._requests[req_id] = tag
        return tag

    def _apply(self, req_id: str, hints: Any) -> tuple[str, str]:
        if not isinstance(hints, dict):
            raise HintError("kv_transfer_params['kvreel'] must be an object")
        wf = _name(hints.get("workflow"), "workflow")
        agent = _name(hints.get("agent"), "agent")
        step = hints.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 1 << 62):
            raise HintError("step must be a non-negative integer")
        run = self._runs.get(wf)
        if "graph" in hints:
            graph = parse_graph(hints["graph"])
            if run is None or run.graph != graph:
                run = _Run(graph)
        if run is None:
            raise HintError(f"workflow {wf!r} has no graph yet (send it with its first request)")
        if agent not in run.graph:
            raise HintError(f"agent {agent!r} is not in workflow {wf!r}'s graph")
        self._runs[wf] = run
        self._runs.move_to_end(wf)
        while len(self._runs) > MAX_WORKFLOWS:
            self._runs.popitem(last=False)
        if step is None or step >= run.step:       # an older step's late request moves nothing
            run.agent, run.running, run.step, run._dist = agent, True, run.step if step is None else step, None
        return wf, agent

    def on_finished(self, req_id: str) -> None:
        tag = self._requests.pop(req_id, None)
        if tag is None:
            return
        run = self._runs.get(tag[0])
        if run is not None and run.agent == tag[1] and run.running and \
                not any(t == tag for t in self._requests.values()):
            run.running, run._dist = False, None

    def steps(self, tag: tuple[str, str]) -> float:
        """Steps until ``tag``'s agent runs next in its workflow (FAR if unknown)."""
        run = self._runs.get(tag[0])
        if run is None:
            return FAR
        return run.distances().get(tag[1], FAR)

    def upcoming(self, depth: int) -> list[tuple[tuple[str, str], int]]:
        """(workflow, agent) pairs at most ``depth`` steps from running (but not running), nearest first."""
        out = [((wf, agent), d) for wf, run in self._runs.items() for agent, d in run.distances().items()
               if 0 < d <= depth]
        return sorted(out, key=lambda x: x[1])


class Workflow:
    """Client-side helper: the ``kv_transfer_params`` of a workflow's requests.

        wf = Workflow("review-7", {"planner": ["coder"], "coder": ["critic"], "critic": ["planner"]})
        client.completions.create(..., extra_body=wf.request("coder"))      # OpenAI server
        SamplingParams(..., extra_args=wf.sampling_extra_args("coder"))      # vllm.LLM

    The graph travels with every request (a few hundred bytes), so a restarted
    engine, or another replica behind a router, learns it from any request.
    """

    def __init__(self, workflow_id: str, graph: dict[str, list[str]]):
        self.id = _name(workflow_id, "workflow")
        self.graph = {a: list(n) for a, n in parse_graph(graph).items()}
        self.step = 0

    def hints(self, agent: str) -> dict:
        """The ``kv_transfer_params`` of the next step, run by ``agent``."""
        if agent not in self.graph:
            raise HintError(f"agent {agent!r} is not in workflow {self.id!r}'s graph")
        self.step += 1
        return {HINTS_KEY: {"workflow": self.id, "agent": agent, "step": self.step, "graph": self.graph}}

    def request(self, agent: str) -> dict:
        """``extra_body`` for an OpenAI client's request."""
        return {"kv_transfer_params": self.hints(agent)}

    def sampling_extra_args(self, agent: str) -> dict:
        """``extra_args`` of vLLM's ``SamplingParams``."""
        return {"kv_transfer_params": self.hints(agent)}
