"""Summarises py-spy raw (collapsed) stacks: the top frames by self samples and by inclusive
samples, as shares of all samples."""

import collections
import sys

own = collections.Counter()
inclusive = collections.Counter()
total = 0
with open(sys.argv[1]) as stacks:
    for line in stacks:
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        count = int(count)
        total += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
print(f"== {sys.argv[1]} samples {total}")
print("-- self")
for frame, count in own.most_common(22):
    print(f"{100 * count / total:5.1f}% {frame[:150]}")
print("-- inclusive")
for frame, count in inclusive.most_common(30):
    print(f"{100 * count / total:5.1f}% {frame[:150]}")
