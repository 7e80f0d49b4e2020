"""Names in scripts without letter case: Chinese, Japanese, Korean, Arabic, ... have no
capitals to tell a name by, so `entities` takes the titles and names these writing systems set
apart with their own marks (《…》, 〈…〉, 「…」, 『…』, «…», „…“, ‚…‘), and the bridge path
counts a 2-character CJK name as a name."""

from __future__ import annotations

from branchsearch.orchestrator.chains import bridges
from branchsearch.workers.branch import BranchReport
from branchsearch.workers.harness import EpisodeResult
from branchsearch.workers.heuristic.titles import NAMES_EXACTLY, names
from branchsearch.workers.text import entities, sentences


def test_entities_take_the_titles_that_caseless_scripts_mark():
    # Chinese: book-title marks, for a book and for a chapter
    assert entities("孔子的弟子把他的言行编成了《论语》，后人又写了〈学而〉篇的注释。") == [
        "论语", "学而"]
    # Japanese: white and plain corner brackets
    assert entities("夏目漱石は『吾輩は猫である』を書き、「東京」に住んだ。") == [
        "吾輩は猫である", "東京"]
    assert entities("한강은 「채식주의자」를 썼다.") == ["채식주의자"]  # Korean
    # Arabic: guillemets
    assert entities("كتب نجيب محفوظ «الثلاثية» في القاهرة.") == ["الثلاثية"]
    # the guillemets and low-9 quotes of cased scripts, before their capitalised names
    assert entities("Le journal « Le Monde » paraît à Paris.") == ["Le Monde", "Paris"]
    assert entities("Er las „Der Prozess“ und ‚Faust‘ von Goethe.") == [
        "Der Prozess", "Faust", "Goethe"]
    # caseless text with nothing marked has no name; a lone marked character is no title
    assert entities("孔子是春秋时期的思想家。") == [] and entities("《易》是一部书。") == []
    assert entities("「" + "长" * 41 + "」") == []  # past the bound: a quoted passage
    # a Latin name in unspaced text ends where its letters do, not at the next space
    assert entities("ソニーの社員はGoogleで働く。") == ["Google"]


def test_entities_in_english_are_as_they_were():
    sentence = ('He is best known for directing horror films such as "Sinister", "The '
                'Exorcism of Emily Rose", and "Deliver Us From Evil", as well as the 2016 '
                'Marvel Cinematic Universe installment, “Doctor Strange.”')
    assert entities(sentence) == ["Sinister", "The Exorcism of Emily Rose",
                                  "Deliver Us From Evil", "Doctor Strange.",
                                  "Exorcism of Emily Rose", "Marvel Cinematic Universe",
                                  "Doctor Strange"]


def test_a_cjk_full_stop_ends_a_sentence_but_not_a_marked_title():
    assert sentences("東京は首都です。大阪は都市です。「君の名は。」は映画。") == [
        "東京は首都です。", "大阪は都市です。", "「君の名は。」は映画。"]
    assert sentences("Rome is old. Paris is not!  Is it?") == [
        "Rome is old.", "Paris is not!", "Is it?"]


def test_a_two_character_cjk_name_is_long_enough():
    from branchsearch.workers.text import too_short

    assert not too_short("论语", 4) and not too_short("東京", 3) and not too_short("서울", 4)
    assert too_short("東", 4) and too_short("Ohi", 4) and not too_short("Ohio", 4)
    assert names("東京", "東京") == NAMES_EXACTLY  # a bridge hit's title names its 2-char name


def _top(title: str, text: str) -> BranchReport:
    ev = [{"chunk_id": "kongzi#p0", "doc_id": "kongzi", "title": title, "text": text}]
    return BranchReport(0, "q", 1.0, "original", episode=EpisodeResult(
        subquery="q", termination="finish", evidence=ev, ranked_chunk_ids=["kongzi#p0"]))


def test_a_bridge_is_a_marked_two_character_name_of_the_top_chunk():
    """In text without spaces the word positions are the runs between punctuation, which a
    question's run seldom matches: the names come in the order the chunk writes them, and
    the sub-query keeps the question's runs."""
    report = _top("孔子", "孔子是鲁国的思想家。弟子们把他的言行编成了《论语》，"
                          "他还整理了《春秋》。")
    question = "孔子的弟子编成的书有多少篇？"
    assert bridges(report, question, 2) == [("论语", "论语 孔子的弟子编成的书有多少篇"),
                                            ("春秋", "春秋 孔子的弟子编成的书有多少篇")]
    # a name the question holds, or the hop before writes (unmarked, inside a run), is not next
    assert [n for n, _ in bridges(report, "《论语》有多少篇？", 2)] == ["春秋"]
    assert [n for n, _ in bridges(report, question, 2, before="后人读论语")] == ["春秋"]
