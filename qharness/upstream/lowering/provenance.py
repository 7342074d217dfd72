"""Speed-up: share fx node provenance instead of deep-copying it on every re-trace (torch.fx.traceback.NodeSource)."""

from __future__ import annotations

from qharness.upstream.lowering.patching import patched


def patch():
    """torch.fx.traceback.NodeSource.__init__ deep-copies the node's whole provenance chain
    (``meta["from_node"]``) each time a pass re-creates a node. Every retrace adds a level, and
    lowering runs hundreds of retraces (run_decompositions, edge passes, 17 XNNPACK passes per
    partition), so the copies grow quadratically (a third of lowering time). The chain is read-only
    history (debug handles come from its oldest entry); sharing it gives the same result."""
    from torch.fx import traceback as fx_traceback

    cls = fx_traceback.NodeSource
    upstream_init = cls.__init__

    def init(self, node, pass_name="", action=None):
        upstream_init(self, None, pass_name, action)
        if node:
            self.node_info = self.NodeInfo(name=node.name, target=str(node.target), graph_id=id(node.graph))
            self.from_node = list(node.meta.get("from_node", ()))

    return patched(cls, "__init__", init)
