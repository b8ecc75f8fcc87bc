"""ZeRO-3 phase 2: gather each parameter next to the layer that reads it, inside the graph.

A pure rewrite of ORT's gradient model (after :func:`ortfx.passes.feeds_after_readers`) for
a module whose parameters are fed through PythonOps (memory-efficient gradients):

* **forward**: each feed node waits for the layer's input (a ``com.microsoft::PassThrough``
  over the feed's trigger and that activation, no copy), so the gather runs when the layer is
  about to run, not all at the start;
* **backward**: the backward nodes that read a parameter (``dX = dY·W``) read a second feed
  node instead, which waits for the gradient arriving at that layer. The forward's value then
  has no backward reader, and ORT frees it after its last forward reader instead of keeping it
  for the backward. Layout nodes between the parameter and a backward reader (``W^T``) are
  cloned into the backward.

The second feed node runs the same Function in ORT's backward; see
:mod:`ortfx.runtime.memgrad` (``Fetcher``) and :mod:`ortfx.hooks.zero3`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

import onnx

from ortfx.passes.feeds import LAYOUT_OPS, downstream


def _is_feed(node: onnx.NodeProto, function: str) -> bool:
    return node.op_type == "PythonOp" and any(
        a.name == "func_name" and a.s.decode() == function for a in node.attribute
    )


def gather_per_layer(model: onnx.ModelProto, function: str) -> bool:
    """Rewrite ``model`` (a gradient model) in place; True if anything changed."""
    graph = model.graph
    # One list of node objects: ids of protobuf wrappers are stable only while they are held.
    all_nodes = list(graph.node)
    feeds = [n for n in all_nodes if _is_feed(n, function)]
    yields = [n for n in all_nodes if n.op_type == "YieldOp"]
    if not feeds or not yields:
        return False
    backward = downstream(graph, {o for n in yields for o in n.output})
    position = {id(n): k for k, n in enumerate(all_nodes)}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in all_nodes:
        for name in dict.fromkeys(node.input):
            consumers.setdefault(name, []).append(node)
    # Values that cannot order a feed: graph inputs, initializers, constants, other feeds.
    fixed = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    fixed |= {o for n in all_nodes if n.op_type == "Constant" for o in n.output}
    fixed |= {o for n in feeds for o in n.output}

    def in_backward(node: onnx.NodeProto) -> bool:
        return any(o in backward for o in node.output)

    before: dict[int, list[onnx.NodeProto]] = {}  # node id -> nodes inserted before it
    moved: set[int] = set()
    producers = {o: n for n in all_nodes for o in n.output}

    def through_barriers(name: str) -> str:
        # feeds_after_readers puts a PassThrough (outputs alias inputs) over the gradient
        # node's context: find the feed's own context behind it.
        node = producers.get(name)
        while node is not None and node.op_type == "PassThrough":
            name = node.input[list(node.output).index(name)]
            node = producers.get(name)
        return name

    grads = {
        through_barriers(n.input[0]): n.output[0] for n in all_nodes if n.op_type == "PythonOpGrad"
    }
    waits: list[tuple[onnx.NodeProto, str | None]] = []  # regather waits, gradient done
    for k, feed in enumerate(feeds):
        param, trigger = feed.output[1], feed.input[0]
        readers = sorted(consumers.get(param, []), key=lambda n: position[id(n)])
        forward = [n for n in readers if not in_backward(n)]
        if forward:
            first = forward[0]
            order = _layer_input(first, consumers, fixed, position)
            if order is not None:
                wait = _wait(f"ortfx_layerwise_feed_{k}", trigger, order)
                feed.input[0] = wait.output[0]
                before.setdefault(id(first), []).extend([wait, feed])
                moved.add(id(feed))
        copies = _regather(feed, trigger, k, consumers, in_backward, position)
        done = grads.get(feed.output[0])
        for at, inserted in copies:
            before.setdefault(at, []).extend(inserted)
            waits.append((inserted[0], done))
        if not copies and done is not None:
            # No backward reader: the gradient node gathers (AccumulateGrad needs the shape).
            waits.append((producers[done], done))
    if not before:
        return False
    nodes: list[onnx.NodeProto] = []
    for node in all_nodes:
        nodes.extend(before.get(id(node), []))
        if id(node) not in moved:
            nodes.append(node)
    nodes = _sorted(nodes)  # a moved feed may now come before its wait's input
    if _one_layer_at_a_time(nodes, waits):
        nodes = _sorted(nodes)
    copies = [_copy(n) for n in nodes]  # before clearing: the wrappers view graph.node
    del graph.node[:]
    graph.node.extend(copies)
    return True


def _one_layer_at_a_time(
    nodes: list[onnx.NodeProto], waits: list[tuple[onnx.NodeProto, str | None]]
) -> bool:
    """Each backward gather (a re-gather, or a gradient node of a parameter without one) also
    waits until the parameter gathered before it has its gradient accumulated (and so is
    released). ORT otherwise runs the cheap dX chain first and
    the weight gradients last, and every re-gathered weight is alive at once. Skipped where it
    would be a cycle (a tied weight whose gradient waits for a later layer)."""
    position = {id(n): k for k, n in enumerate(nodes)}
    ordered = sorted(waits, key=lambda w: position[id(w[0])])
    changed = False
    for (_, done), (gate, _) in itertools.pairwise(ordered):
        if done is None or done in _reached(nodes, set(gate.output)):
            continue
        if gate.op_type == "PythonOpGrad":
            # A gradient node that gathers: its gradient input waits.
            wait = _wait(f"{gate.name}_layerwise_wait", gate.input[1], done)
            gate.input[1] = wait.output[0]
            nodes.insert(nodes.index(gate), wait)
        else:
            gate.input.append(done)
            gate.output.append(f"{gate.name}_after_{len(gate.output)}")
        changed = True
    return changed


def _reached(nodes: list[onnx.NodeProto], start: set[str]) -> set[str]:
    """Values computed from ``start`` (``nodes`` topologically sorted)."""
    reached = set(start)
    for node in nodes:
        if any(i in reached for i in node.input):
            reached.update(o for o in node.output if o)
    return reached


def _sorted(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """A topological order that keeps the given order wherever it can (Kahn, earliest first)."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waiting = [
        {producer[i] for i in n.input if i in producer and producer[i] != k}
        for k, n in enumerate(nodes)
    ]
    users: dict[int, list[int]] = {}
    for k, deps in enumerate(waiting):
        for d in deps:
            users.setdefault(d, []).append(k)
    ready = [k for k, deps in enumerate(waiting) if not deps]
    heapq.heapify(ready)
    out: list[onnx.NodeProto] = []
    while ready:
        k = heapq.heappop(ready)
        out.append(nodes[k])
        for u in users.get(k, []):
            waiting[u].discard(k)
            if not waiting[u]:
                heapq.heappush(ready, u)
    if len(out) != len(nodes):
        raise ValueError("ortfx layerwise pass: the rewritten gradient graph has a cycle")
    return out


def _layer_input(
    reader: onnx.NodeProto,
    consumers: dict[str, list[onnx.NodeProto]],
    fixed: set[str],
    position: dict[int, int],
) -> str | None:
    """The activation a parameter's first forward reader computes with (through layout nodes
    such as ``W^T``, whose only input is the parameter: then their first reader's)."""
    found: str | None = next((i for i in reader.input if i and i not in fixed), None)
    if found is not None and reader.op_type not in LAYOUT_OPS:
        return found
    after = sorted(consumers.get(reader.output[0], []), key=lambda n: position[id(n)])
    if reader.op_type in LAYOUT_OPS and after:
        return _layer_input(after[0], consumers, fixed | {reader.output[0]}, position)
    return found


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def _wait(name: str, trigger: str, after: str) -> onnx.NodeProto:
    """``trigger``, ready only once ``after`` is (outputs alias inputs: no copy)."""
    return onnx.helper.make_node(
        "PassThrough",
        [trigger, after],
        [f"{name}_trigger", f"{name}_after"],
        name=name,
        domain="com.microsoft",
    )


def _regather(
    feed: onnx.NodeProto,
    trigger: str,
    k: int,
    consumers: dict[str, list[onnx.NodeProto]],
    in_backward: Callable[[onnx.NodeProto], bool],
    position: dict[int, int],
) -> list[tuple[int, list[onnx.NodeProto]]]:
    """Point the backward readers of ``feed``'s parameter (directly or through forward layout
    nodes) at a second feed node in the backward; the nodes to insert, by the node before
    which they go."""
    param = feed.output[1]
    # (reader, input name it reads) pairs in the backward, with the forward layout chain.
    uses: list[tuple[onnx.NodeProto, str, tuple[onnx.NodeProto, ...]]] = []

    def walk(value: str, chain: tuple[onnx.NodeProto, ...]) -> None:
        for node in consumers.get(value, []):
            if node.op_type in ("PythonOpGrad", "PassThrough"):
                continue  # the feed's own gradient node; feeds_after_readers' barriers
            if in_backward(node):
                uses.append((node, value, chain))
            elif node.op_type in LAYOUT_OPS and node.output:
                walk(node.output[0], (*chain, node))

    walk(param, ())
    if not uses:
        return []
    first = min((u[0] for u in uses), key=lambda n: position[id(n)])
    after = next(i for i in first.input if i and i != param and not _from(uses, first, i))
    name = f"ortfx_layerwise_regather_{k}"
    wait = _wait(f"{name}_wait", trigger, after)
    again = onnx.NodeProto()
    again.CopyFrom(feed)
    again.name = name
    del again.input[:]
    again.input.append(wait.output[0])
    del again.output[:]
    again.output.extend([f"{name}_ctx", f"{param}_regathered"])
    for a in again.attribute:
        if a.name == "training_mode":
            a.i = 0  # nothing to keep: this node has no backward of its own
    inserted = [wait, again]
    renamed = {param: f"{param}_regathered"}
    for node, value, chain in uses:
        for layout in chain:
            if layout.output[0] in renamed:
                continue
            clone = onnx.NodeProto()
            clone.CopyFrom(layout)
            clone.name = f"{layout.name}_{name}"
            clone.input[0] = renamed[clone.input[0]]
            del clone.output[:]
            clone.output.append(f"{layout.output[0]}_{name}")
            renamed[layout.output[0]] = clone.output[0]
            inserted.append(clone)
        for j, i in enumerate(node.input):
            if i == value:
                node.input[j] = renamed[value]
    return [(id(first), inserted)]


def _from(
    uses: list[tuple[onnx.NodeProto, str, tuple[onnx.NodeProto, ...]]],
    node: onnx.NodeProto,
    value: str,
) -> bool:
    """Whether ``node`` reads ``value`` as a use of the parameter (not as an ordering input)."""
    return any(n is node and v == value for n, v, _ in uses)
