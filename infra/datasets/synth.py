"""A synthetic enterprise corpus with multi-hop clue chains, written as a BEIR folder.

Each task is a chain  project -> planning doc -> vendor -> contract -> review:

* the planning document of "Project Amber Falcon" (a year) names the selected vendor;
* the vendor's profile names its master contract;
* the contract names the year of its review; the review holds the answer (its outcome).

The question names only the project and asks for the review outcome, so every hop must be
found from the previous one. Look-alike distractors are mined from the same names: the same
project in another year choosing another vendor, the same vendor's older contract, reviews of
the right contract in the wrong year, and documents that meet part of the constraints.
Filler documents (minutes, policies) pad the corpus to `docs`. Deterministic by seed; written
line by line, so millions of documents need no memory.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from branchsearch.infra.errors import BranchsearchError

MAX_DOCS = 1_000_000  # about 210 MB of corpus.jsonl; more is a load test, not a demo corpus
BYTES_PER_DOC = 320  # upper estimate for the free-space check (measured: about 210 per document)
SPARE_BYTES = 64 << 20  # leave this much free after writing


class SynthError(BranchsearchError, ValueError):
    """Bad synth parameters or an output folder that cannot take the corpus."""

ADJ = ("Amber Azure Bold Cedar Cobalt Copper Crimson Delta Ember Frost Golden Granite Indigo "
       "Iron Jade Lunar Maple Marble Nova Onyx Orchid Polar Quartz Raven Ruby Sable Silver "
       "Solar Stone Storm Swift Tidal Topaz Velvet Violet Willow").split()
NOUN = ("Falcon Heron Lynx Otter Panther Badger Condor Coyote Dolphin Eagle Fox Hawk Ibis Jaguar "
        "Kestrel Lark Marten Osprey Puma Quail Raven Salmon Swallow Tiger Viper Walrus Wolf "
        "Wren Yak Zebra Bison Crane Gecko Hornet Mantis").split()
V1 = ("Nor Bright Clear Crest Delta Ever Fair High Keen Lake Mill North Oak Pine Quick River "
      "Silver Stone Sun True West Wind").split()
V2 = "bridge field gate haven mark point ridge stone view wood way well".split()
V3 = ("Systems Logistics Analytics Networks Labs Partners Industries Solutions Robotics "
      "Materials").split()
FIRST = ("Ada Ben Carla Dev Elena Farid Grace Hugo Ines Jonas Kira Liam Maya Nils Olga Priya "
         "Quinn Rosa Sami Tara Uma Victor Wen Yara Zane").split()
LAST = ("Adler Brandt Chen Diaz Eriksen Fischer Garcia Haddad Ito Jansen Kowalski Larsen Moreau "
        "Novak Okafor Petrov Quist Rossi Sato Tanaka Ueda Varga Weber Young Zhou").split()
OUTCOMES = ("renewed for three years", "terminated for missed milestones",
            "renewed with a 12% price cut", "put on probation for six months",
            "extended by one year", "moved to a competitive re-bid", "renewed without changes",
            "cancelled after a security audit")
AREAS = ("warehouse automation", "data platform migration", "field sensor network",
         "customer portal rebuild", "fleet telematics", "supplier analytics",
         "clean-room expansion", "payroll consolidation")


# each task's project name is its own (ADJ x NOUN); more tasks would never find a new one
MAX_TASKS = len(ADJ) * len(NOUN)


@dataclass(frozen=True)
class Chain:
    project: str
    year: int
    vendor: str
    contract: str
    review_year: int
    reviewer: str
    outcome: str
    area: str


MARKER = "synth.json"  # what a folder synth wrote holds: it may write there again


def _check_folder(out: Path, need_bytes: int, force: bool = False) -> None:
    """Stop before writing when `out` is a file, holds files synth did not write (a user's
    BEIR folder would be replaced), cannot be written, or its disk lacks room."""
    import os

    if out.exists() and not out.is_dir():
        raise SynthError(f"synth: {out} is a file, not a folder: give a folder to write into")
    if out.is_dir() and not force and not (out / MARKER).exists():
        held = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        if held:
            shown = ", ".join(held[:3]) + (", …" if len(held) > 3 else "")
            raise SynthError(f"synth: {out} already holds files synth did not write ({shown}); "
                             "give a new or empty folder, or --force to write its corpus.jsonl, "
                             "queries.jsonl and qrels/test.tsv over them")
    base = out
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise SynthError(f"synth: cannot create {out}: {base} is not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise SynthError(f"synth: no permission to write in {base}")
    free = shutil.disk_usage(base).free
    if free < need_bytes + SPARE_BYTES:
        raise SynthError(f"synth: not enough free space in {base}: the corpus needs about "
                         f"{_size(need_bytes)} plus {_size(SPARE_BYTES)} kept spare, "
                         f"{_size(free)} free")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"


def _unique(rng: random.Random, make, seen: set) -> str:
    while True:
        value = make()
        if value not in seen:
            seen.add(value)
            return value


def _prepare(out_dir: str | Path, docs: int, extra_bytes: int, force: bool = False) -> Path:
    """The output folder, checked (size, room) and with its qrels/ made."""
    if docs > MAX_DOCS:
        raise SynthError(f"synth: at most {MAX_DOCS:,} documents (got {docs:,})")
    out = Path(out_dir)
    _check_folder(out, docs * BYTES_PER_DOC + extra_bytes, force)
    try:
        (out / "qrels").mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(json.dumps({"docs": docs}) + "\n")
    except OSError as exc:
        raise SynthError(f"synth: cannot create {out}: {exc.strerror}") from None
    return out


def _check_sizes(docs: int, tasks: int) -> None:
    """Each task's chain and distractors need eight documents."""
    if tasks < 1:
        raise SynthError(f"synth: --tasks must be at least 1 (got {tasks})")
    if docs < tasks * 8:
        raise SynthError(f"synth: --docs must be at least 8 × --tasks, {tasks * 8:,} for "
                         f"--tasks {tasks:,} (got --docs {docs:,})")


def synth(out_dir: str | Path, docs: int = 2000, tasks: int = 100, seed: int = 7,
          force: bool = False) -> dict:
    """Write corpus.jsonl, queries.jsonl and qrels/test.tsv; returns counts."""
    if tasks > MAX_TASKS:  # first: more documents would not make room for them
        raise SynthError(f"synth: at most {MAX_TASKS:,} tasks (got {tasks:,})")
    _check_sizes(docs, tasks)
    out = _prepare(out_dir, docs, tasks * 600, force)
    rng = random.Random(seed)
    seen: set = set()
    person = lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}"  # noqa: E731
    project = lambda: f"Project {rng.choice(ADJ)} {rng.choice(NOUN)}"  # noqa: E731
    vendor = lambda: f"{rng.choice(V1)}{rng.choice(V2)} {rng.choice(V3)}"  # noqa: E731
    contract = lambda: f"C-{rng.randrange(1000, 9999)}"  # noqa: E731
    written = 0
    tmp = out / "corpus.jsonl.tmp"
    with tmp.open("w") as corpus, (out / "queries.jsonl").open("w") as queries, \
            (out / "qrels" / "test.tsv").open("w") as qrels:
        qrels.write("query-id\tcorpus-id\tscore\n")

        def emit(doc_id: str, title: str, text: str, date: str, acl: tuple = ()) -> str:
            nonlocal written
            row = {"_id": doc_id, "title": title, "text": text, "date": date}
            if acl:
                row["acl"] = list(acl)
            corpus.write(json.dumps(row) + "\n")
            written += 1
            return doc_id

        for t in range(tasks):
            c = Chain(_unique(rng, project, seen), rng.randrange(2016, 2024),
                      _unique(rng, vendor, seen), _unique(rng, contract, seen), 0,
                      person(), rng.choice(OUTCOMES), rng.choice(AREAS))
            c = Chain(**{**c.__dict__, "review_year": c.year + rng.randrange(1, 3)})
            gold = [
                emit(f"t{t}-plan", f"{c.project} ({c.year} plan)",
                     f"Planning document for {c.project}, approved in {c.year}. The {c.area} "
                     f"work stream selected {c.vendor} as primary vendor after a four-way "
                     f"tender. Budget owner: {person()}. Kick-off is planned for Q{rng.randrange(1, 5)}.",
                     f"{c.year}-0{rng.randrange(1, 10)}-1{rng.randrange(0, 9)}"),
                emit(f"t{t}-vendor", c.vendor,
                     f"{c.vendor} is a supplier of {c.area} services. Its master agreement with "
                     f"us is Contract {c.contract}, signed in {c.year}. Account manager: "
                     f"{person()}.", f"{c.year}-01-15"),
                emit(f"t{t}-contract", f"Contract {c.contract}",
                     f"Contract {c.contract} between us and {c.vendor} covers {c.area}. The "
                     f"contract is reviewed in {c.review_year} by {c.reviewer}, who reports to "
                     f"the procurement board.", f"{c.year}-02-01"),
                emit(f"t{t}-review", f"Contract {c.contract} review ({c.review_year})",
                     f"Review of Contract {c.contract} held in {c.review_year}, chaired by "
                     f"{c.reviewer}. Outcome: the contract was {c.outcome}.",
                     f"{c.review_year}-11-20"),
            ]
            # look-alikes: same project another year, same vendor older contract, wrong-year
            # review, a partial match
            other_vendor = _unique(rng, vendor, seen)
            other_contract = _unique(rng, contract, seen)
            emit(f"t{t}-plan-old", f"{c.project} ({c.year - 3} pilot)",
                 f"Pilot plan for {c.project} in {c.year - 3}. The pilot selected "
                 f"{other_vendor} for a limited {c.area} trial.", f"{c.year - 3}-05-02")
            emit(f"t{t}-vendor-old", other_vendor,
                 f"{other_vendor} supplies {c.area} pilots. Master agreement: Contract "
                 f"{other_contract}.", f"{c.year - 3}-05-10")
            emit(f"t{t}-review-wrong-year", f"Contract {c.contract} review ({c.review_year - 2})",
                 f"Interim check of Contract {c.contract} in {c.review_year - 2}, chaired by "
                 f"{person()}. Outcome: the contract was {rng.choice(OUTCOMES)}.",
                 f"{c.review_year - 2}-06-30")
            emit(f"t{t}-contract-old", f"Contract {other_contract}",
                 f"Contract {other_contract} with {c.vendor} for {rng.choice(AREAS)} expired in "
                 f"{c.year - 1}.", f"{c.year - 4}-03-03")
            hops = 4 if t % 3 else 3
            if hops == 4:
                question = (f"What was the outcome of the review of the master contract of the "
                            f"vendor selected in the {c.year} plan for {c.project}?")
            else:  # three hops: vendor named by the plan -> contract -> reviewer
                question = (f"Who reviews the master contract of the vendor selected in the "
                            f"{c.year} plan for {c.project}?")
                gold = gold[:3]
            answer = c.outcome if hops == 4 else c.reviewer
            queries.write(json.dumps({"_id": f"synth-{t}", "text": question, "metadata": {
                "answer": answer, "hops": hops}}) + "\n")
            qrels.writelines(f"synth-{t}\t{g}\t1\n" for g in gold)
        n = 0
        while written < docs:
            kind = n % 3
            if kind == 0:
                emit(f"minutes-{n}", f"Procurement board minutes {n}",
                     f"The board discussed {rng.choice(AREAS)} budgets with {person()} and "
                     f"{person()}. No contract decisions were taken.",
                     f"{rng.randrange(2015, 2025)}-0{rng.randrange(1, 10)}-0{rng.randrange(1, 10)}")
            elif kind == 1:
                emit(f"policy-{n}", f"Travel policy update {n}",
                     f"Employees travelling for {rng.choice(AREAS)} projects book through the "
                     f"portal; {person()} approves exceptions.", f"{rng.randrange(2015, 2025)}-01-01")
            else:
                emit(f"hr-{n}", f"Salary review notes {n}",
                     f"Confidential compensation notes prepared by {person()}.",
                     f"{rng.randrange(2015, 2025)}-12-01", acl=("hr",))
            n += 1
    tmp.replace(out / "corpus.jsonl")
    return {"documents": written, "tasks": tasks, "folder": str(out)}


# --- the hard mode: MuSiQue-like composed questions over ambiguous bridges -------------------

CITY1 = ("Ash Bel Cor Dun Elm Fen Gal Har Ives Kel Lor Mar Nor Ost Pel Quen Ros Sel Tor Ul "
         "Vel Wyn").split()
CITY2 = "ford haven mouth port stead wick bury dale field ton mere brook".split()
LAND1 = "Al Bor Cal Dor Es Fal Gor Hal Is Jor Kal Lum Mor Nal Or Par Ru Sar Tal Ver".split()
LAND2 = "ania avia esia ovia una istan ara ica eland mark".split()
SUFFIX = ("Collective", "Revival", "Project", "Ensemble")
PLACE = ("", "North ", "East ", "Upper ", "Port ")
MAX_HARD_TASKS = 200  # the name pools hold about 1,300 cities and 600 countries


def synth_hard(out_dir: str | Path, docs: int = 1000, tasks: int = 100, seed: int = 7,
               force: bool = False) -> dict:
    """The hard mode of `synth`: 3-4 hop chains  album -> band -> city (-> country), asked as
    one composed question that names only the album ("What is the capital of the country
    containing the city where the band that recorded Cobalt Heron was formed?"). Every bridge
    is ambiguous: a decoy band whose name extends the gold band's ("Raven Lark" / "Raven Lark
    Collective"), a decoy album whose title extends the gold album's, recorded by the decoy
    band, formed in a decoy city of a decoy country. Queries carry `metadata.chain` (the gold
    document ids in hop order), `answer` and `hops`; qrels list the gold chain. Deterministic
    by seed; written like `synth`."""
    if tasks > MAX_HARD_TASKS:  # first: more documents would not make room for them
        raise SynthError(f"synth --hard: at most {MAX_HARD_TASKS} tasks (got {tasks})")
    _check_sizes(docs, tasks)
    out = _prepare(out_dir, docs, tasks * 800, force)
    rng = random.Random(seed)
    seen: set = set()
    person = lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}"  # noqa: E731
    name2 = lambda: f"{rng.choice(ADJ)} {rng.choice(NOUN)}"  # noqa: E731
    city = lambda: f"{rng.choice(PLACE)}{rng.choice(CITY1)}{rng.choice(CITY2)}"  # noqa: E731
    land = lambda: f"{rng.choice(('', 'New ', 'Greater '))}{rng.choice(LAND1)}{rng.choice(LAND2)}"  # noqa: E731,E501
    written = 0
    tmp = out / "corpus.jsonl.tmp"
    with tmp.open("w") as corpus, (out / "queries.jsonl").open("w") as queries, \
            (out / "qrels" / "test.tsv").open("w") as qrels:
        qrels.write("query-id\tcorpus-id\tscore\n")

        def emit(doc_id: str, title: str, text: str) -> str:
            nonlocal written
            corpus.write(json.dumps({"_id": doc_id, "title": title, "text": text}) + "\n")
            written += 1
            return doc_id

        for t in range(tasks):
            album, band = _unique(rng, name2, seen), _unique(rng, name2, seen)
            decoy_band = f"{band} {rng.choice(SUFFIX)}"
            decoy_album = f"{album} {rng.choice(('Live', 'Sessions', 'Redux'))}"
            town, decoy_town = _unique(rng, city, seen), _unique(rng, city, seen)
            country, decoy_country = _unique(rng, land, seen), _unique(rng, land, seen)
            capital, decoy_capital = _unique(rng, city, seen), _unique(rng, city, seen)
            mayor, decoy_mayor = person(), person()
            year = rng.randrange(1968, 2015)
            chain = [
                emit(f"h{t}-album", f"{album} (album)",
                     f"{album} is the debut studio album by the band {band}, released in "
                     f"{year}."),
                emit(f"h{t}-band", band,
                     f"{band} is a rock band formed in {town} in {year - 2}. The band "
                     f"signed with {rng.choice(V1)} Records."),
                emit(f"h{t}-city", town,
                     f"{town} is a city in {country}. Its mayor is {mayor}."),
                emit(f"h{t}-country", country,
                     f"{country} is a country whose capital is {capital}."),
            ]
            # the decoy bridge: a look-alike album and band, another city and country
            emit(f"h{t}-decoy-album", f"{decoy_album} (album)",
                 f"{decoy_album} is a live album by the band {decoy_band}, released in "
                 f"{year + 3}.")
            emit(f"h{t}-decoy-band", decoy_band,
                 f"{decoy_band} is a rock band formed in {decoy_town} in {year + 1}, named "
                 f"after {band}.")
            emit(f"h{t}-decoy-city", decoy_town,
                 f"{decoy_town} is a city in {decoy_country}. Its mayor is {decoy_mayor}.")
            emit(f"h{t}-decoy-country", decoy_country,
                 f"{decoy_country} is a country whose capital is {decoy_capital}.")
            hops = 4 if t % 2 else 3
            if hops == 4:
                question = (f"What is the capital of the country containing the city where "
                            f"the band that recorded {album} was formed?")
                answer = capital
            else:
                question = (f"Who is the mayor of the city where the band that recorded "
                            f"{album} was formed?")
                answer, chain = mayor, chain[:3]
            queries.write(json.dumps({"_id": f"hard-{t}", "text": question, "metadata": {
                "answer": answer, "hops": hops, "chain": chain}}) + "\n")
            qrels.writelines(f"hard-{t}\t{g}\t1\n" for g in chain)
        n = 0
        while written < docs:
            emit(f"filler-{n}", f"Tour diary {n}",
                 f"{person()} and {person()} toured {rng.choice(CITY1)}{rng.choice(CITY2)} "
                 f"with {rng.choice(ADJ)} {rng.choice(NOUN)} in {rng.randrange(1970, 2020)}.")
            n += 1
    tmp.replace(out / "corpus.jsonl")
    return {"documents": written, "tasks": tasks, "folder": str(out)}
