"""``draftline lineage``: walk a version's ancestry back to its external root through the registry."""

from __future__ import annotations

from draftline import names
from draftline.errors import RegistryError
from draftline.registry.versions import resolve_version


def ancestors(client, uri: str, max_depth: int = 64) -> list[dict]:
    """Generations from ``uri`` back to the root: registered versions, then the external parent (or random)."""
    chain: list[dict] = []
    seen: set[tuple] = set()
    name, mv = resolve_version(client, uri)
    while True:
        key = (name, str(mv.version))
        if key in seen or len(chain) >= max_depth:
            raise RegistryError(f"the lineage of {uri} loops at models:/{name}/{mv.version}")
        seen.add(key)
        tags = mv.tags
        chain.append({
            "kind": "version", "uri": f"models:/{name}/{mv.version}", "stage": mv.current_stage,
            "parent": tags.get(names.PARENT_SOURCE), "parent_sha256": tags.get(names.PARENT_SHA256),
            "data_digest": tags.get(names.DATA_DIGEST), "verifier": tags.get(names.VERIFIER_NAME_OR_PATH),
            "vocab_policy": tags.get(names.VOCAB_POLICY), "finetune_run_id": tags.get(names.FINETUNE_RUN_ID),
            "metrics": {k: float(tags[f"metric.{k}"]) for k in names.HEADLINE_METRICS if f"metric.{k}" in tags},
        })
        parent = tags.get(names.PARENT_SOURCE) or "none"
        if not parent.startswith("models:/"):
            chain.append({"kind": "root", "uri": parent if parent != "none" else "random init",
                          "sha256": tags.get(names.PARENT_SHA256), "revision": tags.get(names.PARENT_REVISION)})
            return chain
        name, mv = resolve_version(client, parent)


def render(chain: list[dict]) -> str:
    head = " <- ".join(g["uri"].removeprefix("models:/") if g["kind"] == "version" else
                       f"{g['uri']}" + (f" (sha256 {g['sha256'][:12]})" if g.get("sha256") not in (None, "none")
                                        else "") for g in chain)
    lines = [head]
    for g in chain:
        if g["kind"] != "version":
            continue
        metrics = ", ".join(f"{k}={v:.3f}" for k, v in g["metrics"].items())
        stage = f" [{g['stage']}]" if g["stage"] not in (None, "", "None") else ""
        lines.append(f"  {g['uri']}{stage}: data {str(g['data_digest'])[:12]}, vocab {g['vocab_policy']}, "
                     f"finetune run {g['finetune_run_id']}" + (f"; {metrics}" if metrics else ""))
    return "\n".join(lines)
