"""Compare two digest files of `digest_plugin.py`: python benchmarks/compare_digests.py before.tsv after.tsv

Prints the results whose model or notes digest differs (test id, index within the test) and
those only in one file."""
import sys


def read(path):
    """(test id, index) -> (model digest, notes digest)."""
    out = {}
    with open(path) as f:
        for line in f:
            tid, n, model, notes = line.rstrip("\n").split("\t")
            out[(tid, int(n))] = (model, notes)
    return out

a, b = read(sys.argv[1]), read(sys.argv[2])
common = sorted(set(a) & set(b))
model_diff = [k for k in common if a[k][0] != b[k][0]]
notes_diff = [k for k in common if a[k][1] != b[k][1]]
print(f"{len(a)} results before, {len(b)} after, {len(common)} in both")
print(f"model digests differ: {len(model_diff)}")
for k in model_diff[:40]:
    print("  MODEL", k[0], k[1], a[k][0], b[k][0])
print(f"notes digests differ: {len(notes_diff)}")
for k in notes_diff[:20]:
    print("  NOTES", k[0], k[1])
only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
print(f"only before: {len(only_a)}; only after: {len(only_b)}")
for k in (only_a + only_b)[:20]:
    print("  ONLY", k)
