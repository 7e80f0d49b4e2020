"""Small text helpers for the heuristic policy: content terms and entity-like phrases."""

from __future__ import annotations

import html
import re
import unicodedata
from functools import lru_cache

STOPWORDS = frozenset("""
a an the and or but if of at by for with about against between into through during before after
above below to from up down in out on off over under again further then once here there when where
why how all any both each few more most other some such no nor not only own same so than too very
can will just don should now is are was were be been being have has had having do does did doing
i me my we our you your he him his she her it its they them their what which who whom this that
these those am as until while also whose did does what's who's name named one two first second
s t year years born known called based located which""".split())

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'\-]*")
# a capital letter: A-Z and the accented and non-Latin capitals of the alphabets before U+0530
# (Latin, Greek, Cyrillic): 'Émile Zola', 'Łódź', 'Øresund' are names as 'Emile Zola' is
_UPPER = "A-Z" + "".join(re.escape(c) for c in map(chr, range(0xC0, 0x530)) if c.isupper())
# the characters of scripts that do not set their words apart by spaces (Thai, kana, CJK
# ideographs, Hangul syllables): one character, or two, can be a word (東京, 서울)
_UNSPACED_CHARS = ("\u0e00-\u0e7f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                   "\uac00-\ud7af\uf900-\ufaff")
# a capitalised word goes on in word characters of a spaced script: in 'Googleで働く' (no space
# after a Latin name in Japanese text) the name is 'Google', not the whole run
_GOES_ON = rf"(?:[^\W{_UNSPACED_CHARS}]|-)"
_CAP_WORD = (rf"(?:[{_UPPER}]\.(?:[{_UPPER}]\.)*"
             rf"|[{_UPPER}]{_GOES_ON}*(?:'(?!s\b){_GOES_ON}+)?)")
_ENTITY = re.compile(rf"{_CAP_WORD}(?:\s+(?:(?:of|the|de|la|le|von|van|du|and|for)\s+)?{_CAP_WORD})*")
# The marks that set a title or a name apart, the one home of these pairs: (opening marks,
# closing marks, fewest and most characters between). Scripts without letter case (Chinese,
# Japanese, Korean, Arabic, Hebrew, ...) have no capitals to tell a name by; what they mark is
# all `entities` finds there. The content stops at the pair's first closing mark; an unclosed
# opening mark pairs with a later closing one only within the bound.
_QUOTE_PAIRS = (
    ('"“', '"”', 3, 80),  # English: straight and curly double quotes
    ("„", "“”", 3, 80),  # German, Polish, Czech, ...: low-9 double quotes („Faust“, „Lalka”)
    ("‚", "‘’", 3, 80),  # their low-9 single quotes (‚Faust‘)
    ("«", "»", 3, 80),  # guillemets: French, Russian, Arabic, Persian, ... («Le Monde»)
    ("《", "》", 2, 40),  # Chinese book-title marks: 《论语》, and 〈…〉 for an article or a
    ("〈", "〉", 2, 40),  # chapter (2 characters up: one is a word, hardly a title)
    ("「", "」", 2, 40),  # corner brackets (Japanese, Chinese): 「東京」; and the white ones
    ("『", "』", 2, 40),  # 『…』 for a book's title or a quote inside a quote
)
_QUOTED = re.compile("|".join(
    f"[{re.escape(opening)}]([^{re.escape(closing)}]{{{fewest},{most}}})[{re.escape(closing)}]"
    for opening, closing, fewest, most in _QUOTE_PAIRS))
_LEADING = frozenset("The A An In On At For By From With During After Before This That These "
                     "Those It He She They His Her Their Its When While Where What Which Who "
                     "How Why Is Are Was Were Did Does Do Has Have Had As Of And Or But If "
                     "Although Since Until Also Both Each Many Most Some Other".split())


# letters that Unicode does not decompose into a base letter and a mark
_LETTERS = str.maketrans({"ß": "ss", "ẞ": "SS", "æ": "ae", "Æ": "AE", "œ": "oe", "Œ": "OE",
                          "ø": "o", "Ø": "O", "đ": "d", "Đ": "D", "ł": "l", "Ł": "L", "ð": "d",
                          "Ð": "D", "þ": "th", "Þ": "Th", "ı": "i"})
# the combining diacritical marks (the blocks Latin, Greek and Cyrillic accents come from; the
# vowel signs of other scripts are letters, not accents, and stay)
_MARKS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]+")


def fold(text: str) -> str:
    """`text` without accents: 'Aschenbrödel' -> 'Aschenbrodel', 'Øresund' -> 'Oresund'. A
    question typed without them names the same page, so every comparison of names and terms
    folds; the lexical stores index the same way (tantivy's `ascii_fold` filter,
    Elasticsearch's `asciifolding`), so a search finds the page either way."""
    return text if text.isascii() else _fold_accented(text)


@lru_cache(maxsize=4096)
def _fold_accented(text: str) -> str:
    """(Cached: a rescoring folds the same chunk texts again at every turn.)"""
    decomposed = unicodedata.normalize("NFKD", text.translate(_LETTERS))
    return unicodedata.normalize("NFC", _MARKS.sub("", decomposed))


def folded(text: str) -> str:
    """`fold`ed and lower-cased: the form in which names are compared."""
    return fold(text).lower()


@lru_cache(maxsize=65536)
def stem(word: str) -> str:
    w = word.lower().strip("'-.")
    if w.endswith("'s"):
        w = w[:-2]
    for suffix in ("ies", "es", "s"):
        if w.endswith(suffix) and len(w) > len(suffix) + 3:
            return w[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return w


PREFIX = 5  # letters two `words` share at their start to count as one (a stemmer's reach)
_UNSPACED = re.compile(f"[{_UNSPACED_CHARS}]")  # Thai, kana, CJK, Hangul syllables


def words(text: str) -> set[str]:
    """`terms` of any script, split at every non-word character ('Hork-Bajir' is two): the
    words a lexical index would find, loosely."""
    return {stem(w) for w in re.findall(r"\w+", folded(text))
            if len(w) > 1 and w not in STOPWORDS}


def unspaced(text: str) -> bool:
    """Whether `text` is (partly) in a script whose words are not set apart by spaces, or
    whose words take attached particles (Chinese, Japanese, Thai, Hangul)."""
    return bool(_UNSPACED.search(text))


@lru_cache(maxsize=8192)
def terms(text: str) -> frozenset[str]:
    """Content terms: lower-cased, accents and plurals folded, stopwords dropped. (Cached: the
    policy asks for the same chunk's terms at every turn's rescoring.)"""
    return frozenset(stem(w) for w in _WORD.findall(fold(text))
                     if w.lower() not in STOPWORDS and len(w) > 1)


def entities(text: str, context: str | None = None) -> list[str]:
    """Quoted and marked titles (`_QUOTE_PAIRS`: "…", 《…》, 「…」, «…», „…“, ...), then
    capitalised phrases, in order of first appearance, de-duplicated. In a script without
    letter case (Chinese, Japanese, Korean, Arabic, ...) only the marked names are found: no
    capital tells a name there, and no word is segmented to guess one.

    With `context` (the passage `text` is a sentence of), a lone word that opens the sentence
    is a name only if the passage also capitalises it where position does not ("Planning
    document for ...", "Interestingly, ..." are not names; "DNA" and "CD4" are by their
    shape). Without it (a question), only an opening stopword ("There", "Here") is dropped."""
    found: list[str] = [m[m.lastindex].strip() for m in _QUOTED.finditer(text)]
    opening = _opening(text)
    for m in _ENTITY.finditer(text):
        phrase = m.group(0).rstrip(".")
        words = phrase.split()
        while context is not None and m.start() == opening and len(words) > 1 \
                and _heading(words[0]):
            words = words[1:]  # "RESULTS There were …", "METHODS Cervical …": a section heading
        if m.start() == opening and len(words) == 1 and (
                words[0].lower() in STOPWORDS  # "There is a country where ..."
                or context is not None and not _named_elsewhere(words[0], context)):
            continue
        while words and words[0] in _LEADING:
            words = words[1:]
        while words and words[-1].lower() in ("of", "the", "and", "de", "for", "in"):
            words = words[:-1]
        if words and not (len(words) == 1 and len(words[0]) < 3):
            found.append(" ".join(words))
            if " and " in found[-1]:  # "Scott Derrickson and Ed Wood": keep the parts too
                found += [p for p in found[-1].split(" and ") if len(p) > 2]
    seen, out = set(), []
    for e in found:
        key = e.lower()
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _heading(word: str) -> bool:
    """A section heading opening a sentence of a passage (BACKGROUND, RESULTS, METHODS): a word
    of six or more capital letters and nothing else (shorter ones are mostly acronyms: NASA,
    UEFA), followed by the sentence it heads."""
    return len(word) >= 6 and word.isalpha() and word.isupper()


def _named_elsewhere(word: str, context: str) -> bool:
    """Whether `word` is a name by its shape (a capital or digit after its first letter) or
    by the passage capitalising it somewhere other than a sentence's first word."""
    if any(c.isupper() or c.isdigit() for c in word[1:]) and not _heading(word):
        return True  # (a heading's capitals are not a name's: DESIGN, SETTING)
    return word in _inner_words(context)


_TOKEN = re.compile(r"[\w'\-]+")


@lru_cache(maxsize=512)
def _inner_words(context: str) -> frozenset[str]:
    """The passage's words that are not a sentence's first (once per passage: a chunk's
    every sentence asks about the same passage)."""
    out: set[str] = set()
    for sentence in sentences(context):
        start = _opening(sentence)
        tokens = [m for m in _TOKEN.finditer(sentence) if m.start() >= start]
        while len(tokens) > 1 and _heading(tokens[0].group(0)):
            tokens = tokens[1:]  # the heading's sentence opens at the next word
        out.update(m.group(0) for m in tokens[1:])
    return frozenset(out)


def _opening(sentence: str) -> int:
    """Where a sentence's first word starts (after leading quotes and brackets)."""
    return len(sentence) - len(sentence.lstrip(" \"'“‘(["))


def has_phrase(text: str, phrase: str) -> bool:
    r"""Whether `phrase` occurs in `text` as whole words ("Uni" is not in "University"): the
    regex `(?<!\w)phrase(?!\w)`, found with `str.find` (compiling a pattern per phrase cost
    more than the searches it served)."""
    if not phrase:
        return re.search(r"(?<!\w)(?!\w)", text) is not None
    start = text.find(phrase)
    while start != -1:
        end = start + len(phrase)
        if ((start == 0 or not _word_char(text[start - 1]))
                and (end == len(text) or not _word_char(text[end]))):
            return True
        start = text.find(phrase, start + 1)
    return False


@lru_cache(maxsize=4096)
def _word_char(char: str) -> bool:
    return _WORD_CHAR.match(char) is not None


_WORD_CHAR = re.compile(r"\w")


_ENTITY_REF = re.compile(r"&(?:[A-Za-z]+|#[0-9]+|#[xX][0-9A-Fa-f]+);")


@lru_cache(maxsize=16384)
def bare_title(title: str) -> str:
    """Title without a parenthetical or comma qualifier: 'Kiss and Tell (1945 film)' -> 'Kiss
    and Tell', 'Brown County, Kansas' -> 'Brown County'. HTML entities are read as the text
    writes them: a title stored as 'Will &amp; Grace' is the 'Will & Grace' a page names."""
    title = _ENTITY_REF.sub(lambda m: html.unescape(m.group(0)), title)
    return re.sub(r"\s*\([^)]*\)\s*$", "", title).split(",")[0].strip()


@lru_cache(maxsize=16384)
def norm_title(title: str) -> str:
    """`bare_title`, `folded`: 'Kiss and Tell (1945 film)' -> 'kiss and tell', 'Tekezé River'
    -> 'tekeze river'."""
    return folded(bare_title(title))


# a sentence ends at . ! ? and a space, or at a CJK full stop (。！？, no space after it) that
# no closing mark follows: 「君の名は。」 is a title, not the end of one
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])(?![」』》〉）])\s*")


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


def too_short(name: str, fewest: int) -> bool:
    """Whether `name` is too short to be searched for as a name: under `fewest` characters
    (a Latin, Greek, Cyrillic, Arabic, ... name) or, in a script where one character or two
    make a word (CJK ideographs, kana, Hangul, Thai: `unspaced`), under 2 (東京, 서울 and
    《论语》 are names; a lone 東 is not)."""
    return len(name) < (2 if unspaced(name) else fewest)
