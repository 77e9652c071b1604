import re
import sys
from collections import Counter
from pathlib import Path

WORD = re.compile(r"[a-z']+")


def read_words(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return WORD.findall(text.lower())


def count_words(words: list[str], stop_words: set[str]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for word in words:
        if word not in stop_words and len(word) > 2:
            counts[word] += 1
    return counts


def report(counts: Counter[str], top: int = 10) -> str:
    lines = []
    for rank, (word, count) in enumerate(counts.most_common(top), start=1):
        lines.append(f"{rank:2d}. {word:<15} {count}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: wordcount.py FILE [TOP]")
        sys.exit(1)
    path = Path(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    stop_words = {"the", "and", "for", "that", "with", "this", "was", "are"}
    words = read_words(path)
    counts = count_words(words, stop_words)
    print(f"{len(words)} words, {len(counts)} distinct")
    print(report(counts, top))


if __name__ == "__main__":
    main()
