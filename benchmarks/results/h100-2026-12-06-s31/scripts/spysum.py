# summarise py-spy raw (collapsed) stacks: top self frames and top inclusive frames
import sys, collections
self_c = collections.Counter(); incl = collections.Counter(); total = 0
for line in open(sys.argv[1]):
    line = line.rstrip()
    if not line: continue
    stack, _, n = line.rpartition(" ")
    n = int(n); total += n
    frames = stack.split(";")
    self_c[frames[-1]] += n
    for f in set(frames): incl[f] += n
print(f"== {sys.argv[1]} samples {total}")
print("-- self"); [print(f"{100*c/total:5.1f}% {f[:150]}") for f, c in self_c.most_common(22)]
print("-- inclusive"); [print(f"{100*c/total:5.1f}% {f[:150]}") for f, c in incl.most_common(30)]
