"""The English-to-French numbers task: its fixed split (no held-out number is ever trained on), its teacher-forced
batches (section 3.1's offset by one), French written by the rules of the grammar (checked by an oracle written here
from those rules, not by ``num2words``), its scores, and the shipped model's exact match and BLEU on the test set.
"""

from __future__ import annotations

import numpy as np
import pytest

from equivalence.backends import numpy as numpy_adapter
from reference_numpy.tokenizer import pad_rows
from transformer_tasks.copy import TEST, VALIDATION
from transformer_tasks.numbers import (
    DIGIT_WEIGHTS,
    SPLIT_SEED,
    NumbersTask,
    Split,
    english,
    french,
    patterns,
    zero_pattern,
)
from transformer_tasks.translation import load_translator

for _library in ("tokenizers", "num2words", "sacrebleu"):
    pytest.importorskip(_library, reason=f"{_library} (the text extra) is not installed")

ALL = 1_000_000                                                        # the task's numbers are 0 .. 999,999


@pytest.fixture(scope="module")
def shipped():
    return load_translator()


@pytest.fixture(scope="module")
def task(shipped) -> NumbersTask:
    return NumbersTask(shipped[2])


@pytest.fixture(scope="module")
def split() -> Split:
    return Split.make()


# ----------------------------------------------------------------------------- the split

def pattern_size(pattern: str) -> int:
    """How many integers a zero pattern holds, in closed form: 9 choices for every nonzero digit ("0" is one)."""
    return 1 if pattern == "0" else 9 ** pattern.count("x")


def test_a_number_s_pattern_marks_its_zero_digits():
    cases = {0: "0", 5: "x", 80: "x0", 100: "x00", 1000: "x,000", 1001: "x,00x", 100002: "x00,00x",
             971000: "xxx,000", 999999: "xxx,xxx", 405060: "x0x,0x0"}
    assert {n: zero_pattern(n) for n in cases} == cases


def test_patterns_group_every_number_by_its_pattern(split):
    groups = patterns()
    assert len(groups) == 64 and sum(len(g) for g in groups.values()) == ALL
    assert {p: len(g) for p, g in groups.items()} == {p: pattern_size(p) for p in groups}
    rng = np.random.Generator(np.random.PCG64(0))
    for pattern, numbers in groups.items():
        assert all(zero_pattern(n) == pattern for n in rng.choice(numbers, min(50, len(numbers)), replace=False))


def test_the_held_out_sets_are_stratified_by_pattern(split):
    """16 test and 8 validation numbers from each pattern of 729 numbers or more, 10 and 5 from the patterns of 81
    (of 3 digits or more), none from the others: every kind of number is tested."""
    expected_test, expected_validation = {}, {}
    for pattern in patterns():
        size, held = pattern_size(pattern), len(pattern.replace(",", "")) >= 3 and pattern_size(pattern) >= 81
        expected_test[pattern] = min(16, size // 8) if held else 0
        expected_validation[pattern] = min(8, size // 16) if held else 0
    for held_out, expected in ((split.test, expected_test), (split.validation, expected_validation)):
        found = dict.fromkeys(expected, 0)
        for n in held_out:
            found[zero_pattern(n)] += 1
        assert found == expected
    assert len(split.test) == sum(expected_test.values()) == 812
    assert np.array_equal(split.held_out("test"), split.test)
    assert np.array_equal(split.held_out("validation"), split.validation)
    with pytest.raises(ValueError, match=r"^split must be 'test' or 'validation', got 'train'$"):
        split.held_out("train")


def test_every_number_is_in_exactly_one_place(split):
    places = [split.test, split.validation, *split.pool.values()]
    everything = np.concatenate(places)
    assert np.array_equal(np.sort(everything), np.arange(ALL))           # each of 0 .. 999,999 exactly once
    assert len(np.intersect1d(split.test, split.validation)) == 0
    training = np.concatenate(list(split.pool.values()))
    assert not np.isin(split.test, training).any() and not np.isin(split.validation, training).any()
    for pattern, pool in split.pool.items():
        assert {zero_pattern(n) for n in pool[:: max(1, len(pool) // 100)]} == {pattern}
        assert np.array_equal(np.sort(pool), pool)
    assert np.isin(np.arange(100), training).all()                      # the words of the languages are trained


def test_the_split_is_reproducible_and_depends_on_its_seed(split):
    again = Split.make()
    for a, b in ((split.test, again.test), (split.validation, again.validation)):
        assert np.array_equal(a, b)
    assert all(np.array_equal(split.pool[k], again.pool[k]) for k in split.pool)
    assert not np.array_equal(Split.make(SPLIT_SEED + 1).test, split.test)


def test_training_numbers_never_hold_a_held_out_number(split):
    held_out = np.concatenate([split.test, split.validation])
    drawn = np.concatenate([split.training_numbers(128, np.random.Generator(np.random.PCG64([seed, step])))
                            for seed in (0, 1) for step in range(100)])
    assert not np.isin(drawn, held_out).any()
    # patterns follow the documented mixture, within 4 standard deviations of p over these 25,600 draws: half a
    # length by DIGIT_WEIGHTS then a number of that length, half a pattern uniformly
    pool = {pattern: len(numbers) for pattern, numbers in split.pool.items()}
    length_of = {pattern: len(str(int(split.pool[pattern][0]))) for pattern in pool}
    of_length = {k: sum(size for q, size in pool.items() if length_of[q] == k) for k in DIGIT_WEIGHTS}
    total = sum(DIGIT_WEIGHTS.values())
    p = np.array([0.5 * DIGIT_WEIGHTS[length_of[q]] / total * pool[q] / of_length[length_of[q]] + 0.5 / len(pool)
                  for q in pool])
    counts = dict.fromkeys(pool, 0)
    for n in drawn:
        counts[zero_pattern(n)] += 1
    frequency = np.array([counts[q] for q in pool]) / len(drawn)
    assert np.all(np.abs(frequency - p) <= 4 * np.sqrt(p * (1 - p) / len(drawn))), (frequency, p)


def test_training_batches_hold_no_held_out_text(task, shipped, split):
    """The streams the trainer consumes, read back as text: no source or target of the whole test and validation
    sets (``held_out_batch``, every pair of each) in training batches, and the two sets, disjoint, hold as many
    numbers as the split leaves out of the training pool."""
    config, tokenizer = shipped[0], shipped[2]
    held_out_english, held_out_french = set(), set()
    for name in (TEST, VALIDATION):
        batch, references = task.held_out_batch(config, task.held_out_size(name), name, seed=0)
        sources = {tokenizer.decode(row) for row in batch["src"]}
        assert len(sources) == len(set(references)) == len(batch["src"]) == task.held_out_size(name)
        assert not sources & held_out_english, f"{name} pairs in another held-out set"
        held_out_english, held_out_french = held_out_english | sources, held_out_french | set(references)
    pool = sum(len(numbers) for numbers in split.pool.values())
    assert len(held_out_english) == len(held_out_french) == ALL - pool
    for step in range(12):
        batch = task.batch(config, 64, step, seed=step % 3)
        sources = {tokenizer.decode(row) for row in batch["src"]}
        targets = {tokenizer.decode(row) for row in batch["labels"]}
        assert not sources & held_out_english and not targets & held_out_french


# ----------------------------------------------------------------------------- batches

def test_batches_are_reproducible_per_seed_and_step(task, shipped):
    config = shipped[0]
    first = task.batch(config, 16, 5, seed=0)
    assert set(first) == {"src", "tgt", "labels"}
    same = NumbersTask(shipped[2]).batch(config, 16, 5, seed=0)           # a fresh task: a fresh split
    assert all(np.array_equal(first[key], same[key]) for key in first)
    for other in (task.batch(config, 16, 6, seed=0), task.batch(config, 16, 5, seed=1)):
        assert first["src"].tolist() != other["src"].tolist()


def test_a_batch_is_teacher_forcing_of_the_drawn_pairs(task, shipped, split):
    """src = ids + eos + pads; tgt = bos + ids + pads; labels = tgt shifted left by one, with eos (section 3.1)."""
    config, tokenizer = shipped[0], shipped[2]
    pad, bos, eos = config.pad_id, config.bos_id, config.eos_id
    batch = task.batch(config, 32, 7, seed=3)
    src, tgt, labels = batch["src"], batch["tgt"], batch["labels"]
    assert src.dtype == tgt.dtype == labels.dtype == np.int64 and tgt.shape == labels.shape
    numbers = split.training_numbers(32, np.random.Generator(np.random.PCG64([3, 7])))   # the documented stream
    for n, s, t, y in zip(numbers, src, tgt, labels):
        n_src = int(np.argmax(s == eos)) + 1                            # through the first eos
        assert s[n_src - 1] == eos and not np.isin(s[:n_src - 1], [pad, bos, eos]).any()
        assert np.all(s[n_src:] == pad)
        n_tgt = int((t != pad).sum())
        assert t[0] == bos and not np.isin(t[1:n_tgt], [pad, bos, eos]).any() and np.all(t[n_tgt:] == pad)
        assert np.array_equal(y[:n_tgt - 1], t[1:n_tgt]) and y[n_tgt - 1] == eos and np.all(y[n_tgt:] == pad)
        assert tokenizer.decode(s) == english(n) and tokenizer.decode(t) == french(n)
    assert (src[:, -1] != pad).any() and (tgt[:, -1] != pad).any()         # padded to the longest row only


# ----------------------------------------------------------------------------- the corpus is French

FR_UNITS = ("zéro un deux trois quatre cinq six sept huit neuf dix onze douze treize quatorze quinze seize").split()
FR_TENS = {2: "vingt", 3: "trente", 4: "quarante", 5: "cinquante", 6: "soixante"}


def french_below_100(n: int) -> str:
    """1 .. 99: 17-19 and 70-99 are built on dix, soixante and quatre-vingt; 'et un' (and 'et onze') after
    vingt .. soixante, hyphens elsewhere; quatre-vingts takes an s only when nothing follows."""
    if n <= 16:
        return FR_UNITS[n]
    if n < 20:
        return "dix-" + FR_UNITS[n - 10]
    if n < 70:
        tens, unit = divmod(n, 10)
        return FR_TENS[tens] + ("" if unit == 0 else " et un" if unit == 1 else "-" + FR_UNITS[unit])
    if n < 80:
        return "soixante et onze" if n == 71 else "soixante-" + french_below_100(n - 60)
    return "quatre-vingts" if n == 80 else "quatre-vingt-" + french_below_100(n - 80)


def french_group(n: int, last: bool) -> str:
    """1 .. 999; 'cent' is never preceded by 'un'; 'cents' and 'quatre-vingts' keep their s only at the end of
    the number (never before 'mille')."""
    hundreds, rest = divmod(n, 100)
    words = []
    if hundreds:
        words.append("cent" if hundreds == 1 else FR_UNITS[hundreds] + (" cents" if rest == 0 and last else " cent"))
    if rest:
        words.append(french_below_100(rest) if last or rest != 80 else "quatre-vingt")
    return " ".join(words)


def french_oracle(n: int) -> str:
    """0 .. 999,999 in French: 'mille' is invariable and never preceded by 'un'."""
    if n == 0:
        return "zéro"
    thousands, rest = divmod(n, 1000)
    words = [] if thousands == 0 else ["mille"] if thousands == 1 else [french_group(thousands, False) + " mille"]
    return " ".join(words + ([french_group(rest, True)] if rest else []))


EN_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
            "seventeen eighteen nineteen").split()
EN_TENS = {2: "twenty", 3: "thirty", 4: "forty", 5: "fifty", 6: "sixty", 7: "seventy", 8: "eighty", 9: "ninety"}


def english_group(n: int) -> str:
    """1 .. 999, British style: 'and' before the tens and units after a hundred."""
    hundreds, rest = divmod(n, 100)
    tens, unit = divmod(rest, 10)
    below_100 = EN_UNITS[rest] if rest < 20 else EN_TENS[tens] + ("-" + EN_UNITS[unit] if unit else "")
    if not hundreds:
        return below_100
    return EN_UNITS[hundreds] + " hundred" + (" and " + below_100 if rest else "")


def english_oracle(n: int) -> str:
    """0 .. 999,999: 'one thousand, two hundred ...' but 'one thousand and one'."""
    if n == 0:
        return "zero"
    thousands, rest = divmod(n, 1000)
    if not thousands:
        return english_group(rest)
    words = english_group(thousands) + " thousand"
    return words if not rest else words + (", " if rest >= 100 else " and ") + english_group(rest)


@pytest.mark.parametrize("number, text", [
    (80, "quatre-vingts"), (80_000, "quatre-vingt mille"), (81, "quatre-vingt-un"), (91, "quatre-vingt-onze"),
    (71, "soixante et onze"), (21, "vingt et un"), (17, "dix-sept"), (200, "deux cents"), (201, "deux cent un"),
    (200_000, "deux cent mille"), (1_000, "mille"), (1_001, "mille un"), (21_000, "vingt et un mille"),
    (180, "cent quatre-vingts"), (280_000, "deux cent quatre-vingt mille"), (0, "zéro"),
    (497, "quatre cent quatre-vingt-dix-sept"),
])
def test_french_follows_the_grammar(number, text):
    assert french(number) == text and french_oracle(number) == text


@pytest.mark.parametrize("number, text", [
    (497, "four hundred and ninety-seven"), (1_001, "one thousand and one"), (100, "one hundred"),
    (1_234, "one thousand, two hundred and thirty-four"), (201_000, "two hundred and one thousand"),
])
def test_english_follows_the_grammar(number, text):
    assert english(number) == text and english_oracle(number) == text


def test_the_corpus_agrees_with_the_grammar_oracles(task, split):
    rng = np.random.Generator(np.random.PCG64(11))
    numbers = np.concatenate([np.arange(2000), np.arange(0, ALL, 1000), rng.integers(0, ALL, size=1000), split.test])
    sources, targets = task.pairs(numbers)
    for n, source, target in zip(numbers, sources, targets):
        assert target == french_oracle(int(n)), n
        assert source == english_oracle(int(n)), n


# ----------------------------------------------------------------------------- held out and score

def test_held_out_gives_the_split_whatever_the_seed(task, shipped, split):
    config, tokenizer = shipped[0], shipped[2]
    src, references = task.held_out(config, len(split.test), "test", 0)
    assert sorted(references) == sorted(french(n) for n in split.test)
    assert sorted(tokenizer.decode(row) for row in src) == sorted(english(n) for n in split.test)
    translation = {english(n): french(n) for n in split.test}
    assert [translation[tokenizer.decode(row)] for row in src] == references      # each source with its reference
    small_src, small_refs = task.held_out(config, 40, "validation", 0)
    other_src, other_refs = task.held_out(config, 40, "validation", 9)
    assert np.array_equal(small_src, other_src) and small_refs == other_refs
    assert set(small_refs) <= {french(n) for n in split.validation}


@pytest.mark.parametrize("split_name, size", [("test", 812), ("validation", 406)])
def test_held_out_refuses_more_than_the_split_and_none(task, shipped, split_name, size):
    for count in (size + 1, 0):
        with pytest.raises(ValueError, match=rf"^the {split_name} set holds {size} pairs; {count} were asked for "
                                             r"\(at least 1\)$"):
            task.held_out(shipped[0], count, split_name, 0)


def test_score_is_exact_match_and_bleu_of_the_decoded_text(task, shipped):
    config, tokenizer = shipped[0], shipped[2]
    references = ["vingt et un", "deux cent mille trois cent un"]

    def decoded(texts, tail=()):
        return pad_rows([[*tokenizer.encode(text), config.eos_id, *tail] for text in texts], config.pad_id)

    perfect = task.score(config, decoded(references, tail=tokenizer.encode("neuf")), references)  # after eos: ignored
    assert perfect["exact"] == 1.0 and perfect["bleu"] == pytest.approx(100.0)
    wrong = task.score(config, decoded(["vingt et un", "deux cent mille trois cent deux"]), references)
    # corpus BLEU (Papineni et al., 2002) by hand: n-gram precisions 8/9, 6/7, 4/5, 2/3, equal lengths (no penalty)
    assert wrong["exact"] == 0.5
    assert wrong["bleu"] == pytest.approx(100 * (8 / 9 * 6 / 7 * 4 / 5 * 2 / 3) ** 0.25, rel=1e-12)


# ----------------------------------------------------------------------------- the shipped model

def test_the_shipped_model_is_the_tasks_recipe(task, shipped):
    config, _, tokenizer = shipped
    assert task.config() == config
    assert task.with_tokenizer(config) is task
    assert NumbersTask().with_tokenizer(config).tokenizer.to_json() == tokenizer.to_json()   # learned again, same


def test_the_shipped_model_translates_the_test_set(task, shipped):
    config, params, _ = shipped
    src, references = task.held_out(config, 200, "test", 0)
    decoded = numpy_adapter.greedy(numpy_adapter.build(config, params, "float64"), src)
    score = task.score(config, decoded, references)
    assert score["exact"] >= 0.95 and score["bleu"] >= 95, score


def test_the_shipped_model_translates_every_kind_of_number(split):
    """Every zero pattern of the test split is translated at least 99% exactly (its 10 or 16 numbers: all of them),
    greedy, in the first installed port (the whole split; scripts/numbers_patterns.py runs every backend on larger
    samples). The French is checked by the grammar oracle above, not by num2words."""
    from equivalence import backends
    from transformer_tasks.translation import translator

    ports = backends.load()[0]
    if not ports:
        pytest.skip("no port framework is installed: the whole test split is too slow for the NumPy reference here")
    name, adapter = next(iter(ports.items()))
    translate = translator(adapter, batch_size=256)
    wrong: dict[str, list] = {}
    for n, text in zip(split.test, translate([english(n) for n in split.test])):
        if text != french_oracle(int(n)):
            wrong.setdefault(zero_pattern(n), []).append((int(n), text))
    counts = {pattern: int(sum(zero_pattern(n) == pattern for n in split.test)) for pattern in patterns()}
    assert all(len(wrong.get(p, [])) <= 0.01 * count for p, count in counts.items() if count), (name, wrong)
