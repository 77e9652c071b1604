"""Gather the training text for Coda's embedded default model (offline, registries only).

Every source comes from a package registry (Debian apt, PyPI) and is public domain or
permissively licensed; ``coda/assets/default_model/README.md`` lists each one with its licence.
GPL-licensed fortune collections (de, zh, ru, pl, cs, br) are deliberately excluded.

Sources:
  * Debian ``fortunes`` / ``fortunes-min`` (BSD), ``fortunes-it`` (public domain),
    ``fortunes-es`` (texts presumed public domain; only its packaging code is GPL)
  * Debian ``jargon-text`` (the Jargon File, public domain)
  * Debian ``python3.11-doc`` reST sources (PSF License 2.0)
  * PyPI ``babel`` (BSD-3-Clause; its CLDR data is under the Unicode licence) for
    multilingual strings: CJK, Cyrillic, Arabic, accented Latin
  * PyPI ``emoji`` (BSD-3-Clause) for emoji and their names in 14 languages

Usage: ``python scripts/default_model_corpus.py CACHE_DIR OUT.txt`` (needs root for
``apt-get download`` only if the .deb files are not cached yet).
"""

from __future__ import annotations

import gzip
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

DEBS = ["fortunes", "fortunes-min", "fortunes-it", "fortunes-es", "jargon-text", "python3.11-doc"]
PIP = ["babel==2.19.0", "emoji==2.16.0"]
EOT = "<|endoftext|>"
LOCALES = ["zh", "zh_Hant", "ja", "ko", "fr", "de", "es", "it", "pt", "ru", "pl", "cs", "tr",
           "vi", "el", "ar", "he", "hi", "th", "sv", "nl", "fi", "hu", "ro", "uk", "da", "nb"]


def fetch(cache: Path) -> tuple[Path, Path]:
    """Download (once) the Debian packages and PyPI wheels into ``cache``; return roots."""
    debs, root, py = cache / "debs", cache / "root", cache / "py"
    debs.mkdir(parents=True, exist_ok=True)
    if not any(debs.glob("python3.11-doc_*.deb")):
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "download", *DEBS], cwd=debs, check=True)
    if not (root / "usr").exists():
        for deb in sorted(d for name in DEBS for d in debs.glob(f"{name}_*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    if not (py / "babel").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(py), *PIP],
                       check=True)
    return root, py


def _read(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # NOTE: a few old fortune files are ISO-8859-1


def fortunes(root: Path) -> Iterator[str]:
    base = root / "usr/share/games/fortunes"
    for path in sorted(base.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.suffix in {".dat", ".u8"}:
            continue
        if path.name in {"ascii-art", "art", "banner"} or "off" in path.parts:
            continue  # NOTE: drawings teach nothing; off/ is the offensive set
        for cookie in _read(path).split("\n%\n"):
            text = cookie.strip("%\n ").replace("\t", "    ")
            if 20 <= len(text) <= 1500:
                yield text


def jargon(root: Path) -> Iterator[tuple[str, str]]:
    """Yield (headword, definition) pairs from the Jargon File."""
    path = root / "usr/share/doc/jargon-text/jargon.txt.gz"
    text = gzip.decompress(path.read_bytes()).decode("utf-8")
    for block in re.split(r"\n   :(?=[^\n]+?: )", text)[1:]:
        head, _, body = block.partition("\n")
        word = head.split(":", 1)[0].strip()
        paras = [re.sub(r"\s+", " ", p).strip() for p in body.split("\n\n")]
        paras = [re.sub(r"[{}]", "", p) for p in paras if p and not re.search("[│─┼├]", p)]
        if word and paras:
            yield word, "\n\n".join(paras)


_RST = [(re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`"), r"\1"), (re.compile(r"``"), ""),
        (re.compile(r"^\.\. .*$", re.M), ""), (re.compile(r"^[=\-~^*#+\"']{3,}\s*$", re.M), ""),
        (re.compile(r"\*\*?([^*]+)\*\*?"), r"\1"), (re.compile(r"`([^`]*)`_*"), r"\1")]


def python_docs(root: Path) -> Iterator[str]:
    base = root / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(base.rglob("*.rst.txt")):
        if any(p in path.parts for p in ("c-api", "whatsnew", "distutils")):
            continue  # NOTE: keep prose-heavy parts; changelogs and C API are mostly lists
        text = path.read_text("utf-8")
        for pat, rep in _RST:
            text = pat.sub(rep, text)
        for chunk in re.split(r"\n\s*\n", text):
            chunk = chunk.strip()
            if len(chunk) > 120 and chunk.count(" ") > 15 and not chunk.startswith((">>>", "$")):
                yield re.sub(r"\s*\n\s*", " ", chunk)


def cldr(py: Path) -> Iterator[str]:
    """Multilingual lines built from CLDR data shipped in ``babel``."""
    sys.path.insert(0, str(py))
    from datetime import date

    from babel import Locale
    from babel.dates import format_date
    from babel.numbers import format_currency, format_decimal

    rng = random.Random(7)
    codes = ["en", "fr", "de", "ja", "zh", "es", "ru", "ko", "it", "ar", "pt", "hi"]
    for code in LOCALES:
        loc = Locale.parse(code)
        name = loc.get_display_name("en")
        days = list(loc.days["format"]["wide"].values())
        months = list(loc.months["format"]["wide"].values())
        yield f"In {name} ({loc.get_display_name()}), the days of the week are: {', '.join(days)}."
        yield f"The months in {name} are {', '.join(months)}."
        for _ in range(12):
            d = date(rng.randint(1900, 2030), rng.randint(1, 12), rng.randint(1, 28))
            n = rng.randint(1, 10**7) / 100
            yield (f"{format_date(d, 'full', locale=code)} — {format_decimal(n, locale=code)} — "
                   f"{format_currency(n, 'EUR', locale=code)}")
        terr = list(loc.territories.items())
        langs = [(k, v) for k, v in loc.languages.items() if k in codes]
        for i in range(0, len(terr), 8):
            yield f"{name}: " + "、".join(v for _, v in terr[i:i + 8]) if code.startswith(("zh", "ja")) \
                else f"{name}: " + ", ".join(v for _, v in terr[i:i + 8])
        yield f"{name}: " + "; ".join(f"{Locale.parse(k).get_display_name('en')} = {v}"
                                      for k, v in langs)


def emoji_lines(py: Path) -> Iterator[str]:
    sys.path.insert(0, str(py))
    import emoji

    for lang in ("zh", "ja", "ko", "fr", "de", "es", "ru"):
        emoji.config.load_language(lang)
    rng = random.Random(11)
    items = [(e, d) for e, d in emoji.EMOJI_DATA.items() if d.get("status") == 2 and "zh" in d]
    rng.shuffle(items)
    for i in range(0, len(items), 6):
        parts = []
        for e, d in items[i:i + 6]:
            lang = rng.choice(["zh", "ja", "ko", "fr", "de", "es", "ru"])
            en = d["en"].strip(":").replace("_", " ")
            parts.append(f"{e} {en} ({d.get(lang, d['en']).strip(':').replace('_', ' ')})")
        yield "Emoji: " + " · ".join(parts)


def chats(root: Path, py: Path, rng: random.Random) -> Iterator[str]:
    """ChatML samples so chat requests get text-like answers that end with <|im_end|>."""
    def chat(user: str, answer: str, system: str | None = None) -> str:
        sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return (f"{sys_part}<|im_start|>user\n{user}<|im_end|>\n"
                f"<|im_start|>assistant\n{answer}<|im_end|>\n")

    systems = [None, None, "You are a helpful assistant.", "You are Coda, a small demo model."]
    for word, definition in jargon(root):
        q = rng.choice(["What does '{w}' mean?", "Define {w}.", "What is {w}?",
                        "Tell me about {w}.", "Explain the term {w}."]).format(w=word)
        yield chat(q, definition.split("\n\n")[0][:700], rng.choice(systems))
    for text in fortunes(root):
        lines = text.split("\n")
        if len(lines) >= 2 and lines[0].rstrip().endswith("?"):
            yield chat(lines[0].strip(), "\n".join(lines[1:]).strip(), rng.choice(systems))
        elif rng.random() < 0.3:
            q = rng.choice(["Tell me a quote.", "Say something wise.", "Give me a fortune.",
                            "Tell me something interesting.", "Hello!", "Write a short saying."])
            yield chat(q, text, rng.choice(systems))
    for line in emoji_lines(py):
        first = line.removeprefix("Emoji: ").split(" · ")[0]
        yield chat(f"Show me an emoji for {first.split(' (')[0][2:].strip()}.", first)
    for line in cldr(py):
        if line.startswith("In "):
            yield chat("What are the days of the week in " + line[3:].split(" (")[0] + "?", line)


def build(cache: Path, seed: int = 0) -> list[str]:
    """Return shuffled documents (plain text and ChatML) for tokenizer and model training."""
    root, py = fetch(cache)
    rng = random.Random(seed)
    docs: list[str] = []
    docs += list(fortunes(root))
    docs += [f"{w}\n\n{d}" for w, d in jargon(root)]
    pydocs = list(python_docs(root))
    docs += [" ".join(pydocs[i:i + 3]) for i in range(0, len(pydocs), 3)]
    multi = list(cldr(py)) + list(emoji_lines(py))
    docs += multi * 8  # NOTE: upsample: multilingual text is small but must be seen often
    docs += list(chats(root, py, rng))
    rng.shuffle(docs)
    return docs


def main() -> None:
    cache, out = Path(sys.argv[1]), Path(sys.argv[2])
    docs = build(cache)
    out.write_text(EOT.join(docs) + EOT, encoding="utf-8")
    print(f"{len(docs)} documents, {out.stat().st_size / 1e6:.1f} MB -> {out}")


if __name__ == "__main__":
    main()
