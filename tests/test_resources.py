"""What is asked: the claim's fields, the ``%%claim`` line, flavors, settings.

Almost every mistake here is a typo at the top of a cell. The failure guarded
against is a typo that is accepted silently (a cell that runs on a default
nobody chose) or rejected with a message that does not say what to type.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluksio_nb.claim_line import claim_parser, parse_claim_line
from fluksio_nb.errors import BadClaim, BadSettings, UnknownFlavor
from fluksio_nb.flavors import describe_flavors, resolve_flavor
from fluksio_nb.resources import Resources, ask
from fluksio_nb.settings import load_settings

# -----------------------------------------------------------------------------
# Resources
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [("8G", 8 * 10**9), ("512M", 512 * 10**6), ("1.5GiB", 3 << 29), ("1024", 1024)],
)
def test_ram_reads_the_sizes_people_write(text, size):
    assert Resources(ram=text).ram_bytes == size


def test_ram_given_as_plain_bytes_is_taken_as_bytes():
    assert Resources(ram=4096).ram_bytes == 4096


def test_a_misspelled_resource_is_refused_with_the_right_spelling():
    """`cpu=2` must not run with the default one core."""
    with pytest.raises(ValueError) as caught:
        ask(cpu=2)
    message = str(caught.value)
    assert "'cpu'" in message
    assert "did you mean 'cpus'" in message
    assert "cpus, gpus, ram" in message


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"cpus": -1}, "cpus must be at least 1"),
        ({"gpus": -2}, "gpus must be at least 0"),
        ({"cpus": 1.5}, "cpus must be a whole number"),
        ({"gpus": "one"}, "gpus must be a whole number"),
        ({"cpus": True}, "cpus must be a whole number"),
        ({"cpus": 0}, "at least 1"),
        ({"ram": "lots"}, "ram='lots' is not a size"),
        ({"ram": 0}, "more than zero"),
        ({"timeout": -3}, "timeout must be a number of seconds above 0, such as 30 (got -3)"),
    ],
)
def test_bad_counts_and_sizes_are_refused_in_plain_words(fields, words):
    with pytest.raises(BadClaim) as caught:
        ask(**fields)
    assert words in str(caught.value)
    assert "\n" not in str(caught.value), "the error should be one paragraph"


def test_whole_floats_and_digit_strings_are_counts():
    assert Resources(cpus=2.0, gpus="1").cpus == 2


def test_declaring_nothing_asks_for_one_core_and_nothing_else():
    """A bare `%%claim` is a valid claim: one core, no card, no memory accounted."""
    nothing = Resources()
    assert (nothing.cpus, nothing.gpus, nothing.ram) == (1, 0, None)
    assert nothing.ram_bytes == 0


# -----------------------------------------------------------------------------
# The %%claim line
# -----------------------------------------------------------------------------


def test_the_line_splits_resources_env_and_options():
    line = parse_claim_line(
        "cpus=2 gpus=1 ram=8G OMP_NUM_THREADS=1 --label fit --in a,b --out c "
        "--timeout 30 --background --strict"
    )
    r = line.resources
    assert (r.cpus, r.gpus, r.ram_bytes) == (2, 1, 8 * 10**9)
    assert r.env == {"OMP_NUM_THREADS": "1"}
    assert (r.label, r.timeout, r.strict) == ("fit", 30.0, True)
    assert line.inputs == ("a", "b")
    assert line.outputs == ("c",)
    assert line.background is True


def test_pairs_may_come_after_the_options_too():
    line = parse_claim_line("cpus=2 --label fit ram=8G --background OMP_NUM_THREADS=1")
    r = line.resources
    assert (r.cpus, r.ram_bytes, r.label, r.env) == (2, 8 * 10**9, "fit", {"OMP_NUM_THREADS": "1"})
    assert line.background is True


def test_an_empty_line_is_one_core():
    line = parse_claim_line("")
    assert line.resources == Resources()
    assert (line.inputs, line.outputs, line.background) == (None, None, False)


def test_quoted_values_keep_their_spaces():
    line = parse_claim_line("""XLA_FLAGS="--a=1 --b=2" --label 'my fit'""")
    assert line.resources.env == {"XLA_FLAGS": "--a=1 --b=2"}
    assert line.resources.label == "my fit"


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("cpu=2", "did you mean 'cpus'"),
        ("ram=lots", "ram='lots' is not a size"),
        ("cpus", "is not NAME=VALUE"),
        ("cpus=2 cpus=3", "given twice"),
        ("OMP_NUM_THREADS=1 OMP_NUM_THREADS=3", "OMP_NUM_THREADS is given twice"),
        ("--colour red", "unrecognized arguments"),
        ("--in 1x", "is not a Python name"),
        ("--label 'unclosed", "close the quote"),
        ("--timeout soon", "--timeout must be a number of seconds above 0, such as 30 (got soon)"),
        ("Omp_Threads=1", "UPPER_CASE"),
    ],
)
def test_a_bad_line_says_what_to_change(line, words):
    with pytest.raises(BadClaim) as caught:
        parse_claim_line(line)
    assert words in str(caught.value)


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon", "''"])
def test_a_timeout_that_is_not_seconds_above_zero_is_refused_naming_the_option(value):
    """Guards against pydantic's `timeout: Input should be greater than 0.`, which names a
    field the line does not have and says nothing of what to write."""
    with pytest.raises(BadClaim) as caught:
        parse_claim_line(f"--timeout {value}")
    assert str(caught.value) == (
        f"%%claim: --timeout must be a number of seconds above 0, such as 30 (got {value}); "
        "leave it out to wait and run for as long as it takes."
    )


@pytest.mark.parametrize(
    ("line", "option"),
    [
        ("--timeout 1 --timeout 2", "--timeout"),
        ("--timeout=1 --timeout 1", "--timeout"),
        ("--label x --label y", "--label"),
        ("--in a --in b", "--in"),
        ("--out a --out a", "--out"),
        ("--on ray --on ray", "--on"),
        ("--strict --strict", "--strict"),
        ("--background cpus=1 --background", "--background"),
    ],
)
def test_an_option_given_twice_is_refused_as_a_pair_given_twice_is(line, option):
    """Guards against argparse's last-one-wins: `--timeout 1 --timeout 2` ran with 2,
    while `cpus=1 cpus=1` was refused."""
    with pytest.raises(BadClaim) as caught:
        parse_claim_line(line)
    assert str(caught.value) == f"%%claim: {option} is given twice; keep one."


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (
            "--label ''",
            "%%claim: --label is empty; give the name to show in the queue, such as --label "
            "fit, or drop --label to be named as the notebook numbers the cell, In[n].",
        ),
        ("--label ' '", "%%claim: --label is empty;"),
        (
            "--in ''",
            "%%claim: --in names nothing; list the names to ship in, such as --in a,b, or "
            "drop --in to ship in every name the cell reads.",
        ),
        ("--in ,", "%%claim: --in names nothing;"),
        (
            "--out ''",
            "%%claim: --out names nothing; list the names to bring back, such as --out a,b, "
            "or drop --out to bring back every name the cell binds.",
        ),
        (
            "--on ''",
            "%%claim: --on is empty; write --on ray, or a Ray address such as "
            "ray://host:10001, or drop --on to run the cell on this machine.",
        ),
    ],
)
def test_an_empty_label_in_out_or_on_is_refused_saying_what_to_write(line, words):
    """Guards against `--label ''` naming the cell `claim 3` rather than In[n], `--out ''`
    bringing nothing back without a word, and `--on ''` quietly meaning Ray."""
    with pytest.raises(BadClaim) as caught:
        parse_claim_line(line)
    assert str(caught.value).startswith(words)


@pytest.mark.parametrize(
    "line",
    [
        "cpus=0",
        "cpus=x",
        "gpus=-1",
        "ram=lots",
        "ram=0",
        "gpus=1 gpu_ram=x",
        "gpus=1.5",
        "gpus=0.5 gpu_ram=8G",
        "flavor=X",
        "gpus=1 CUDA_VISIBLE_DEVICES=1",
        "--timeout 0",
        "--in 1x",
        "--out a,b-c",
    ],
)
def test_every_bad_value_on_the_line_is_one_paragraph_said_as_a_claim_error(line):
    """Each says `%%claim:` as the line's other refusals do, and none leaks pydantic's
    wording, which names fields rather than what was typed."""
    with pytest.raises(BadClaim) as caught:
        parse_claim_line(line)
    message = str(caught.value)
    assert message.startswith("%%claim: "), message
    assert "\n" not in message
    assert "Input should" not in message and "argument " not in message, message


def test_the_help_text_is_the_parser_that_reads_the_line():
    """`%%claim?` must list every option the parser accepts, so the two cannot drift."""
    text = claim_parser().format_help()
    for option in ("--in", "--out", "--timeout", "--background", "--label", "--strict"):
        assert option in text


_line_words = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["cpus=", "gpus=", "ram=", "flavor=", "--in", "--out", "--timeout", "--label"]
    ).flatmap(lambda key: st.builds(lambda v: key + v, st.text(max_size=6))),
    st.sampled_from(["--background", "--strict", "OMP_NUM_THREADS=2", "'", '"', "-h"]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_line_words, max_size=6).map(" ".join))
def test_any_line_is_a_claim_or_a_clear_error(line):
    """Whatever is typed, the magic must not die with a stray exception."""
    try:
        parsed = parse_claim_line(line)
    except ValueError as error:
        assert str(error)
    else:
        assert isinstance(parsed.resources, Resources)


# -----------------------------------------------------------------------------
# Flavors and settings
# -----------------------------------------------------------------------------


def test_a_flavor_supplies_the_numbers_not_given(isolated_settings):
    resolved = resolve_flavor(parse_claim_line("flavor=gpu-small").resources, load_settings())
    assert (resolved.cpus, resolved.gpus, resolved.ram_bytes) == (4, 1, 16 * 10**9)


def test_numbers_on_the_line_win_over_the_flavor():
    wanted = parse_claim_line("flavor=gpu-small ram=32G --label big").resources
    resolved = resolve_flavor(wanted, load_settings())
    assert (resolved.cpus, resolved.ram_bytes, resolved.label) == (4, 32 * 10**9, "big")


def test_a_user_flavor_comes_from_the_shared_config_file(isolated_settings):
    isolated_settings.write_text(json.dumps({"flavors": {"tiny": {"cpus": 1, "ram": "1G"}}}))
    settings_now = load_settings()
    resolved = resolve_flavor(Resources(flavor="tiny"), settings_now)
    assert resolved.ram_bytes == 10**9
    assert "tiny" in describe_flavors(settings_now)


def test_a_flavor_that_does_not_exist_says_how_to_list_them():
    with pytest.raises(UnknownFlavor) as caught:
        resolve_flavor(Resources(flavor="huge"), load_settings())
    assert "flavor 'huge' does not exist" in str(caught.value)
    assert "fluksio-nb flavors" in str(caught.value)


def test_environment_variables_win_over_the_config_file(isolated_settings, monkeypatch):
    isolated_settings.write_text(json.dumps({"cpus": 8, "gpus": 1, "reserve_cpus": 2}))
    monkeypatch.setenv("FLUKSIO_GPUS", "2")
    loaded = load_settings()
    assert (loaded.cpus, loaded.gpus, loaded.reserve_cpus) == (8, 2, 2)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "is not valid JSON (line 1"),
        ('{"cpu": 4}', "unknown setting 'cpu' (did you mean 'cpus'?)"),
        ("[1, 2]", "must hold a JSON object"),
        (b'\xff\xfe{"cpus": 2}', "is not UTF-8 text (byte 0: invalid start byte)"),
    ],
)
def test_a_broken_config_file_names_itself(isolated_settings, content, words):
    if isinstance(content, bytes):
        isolated_settings.write_bytes(content)
    else:
        isolated_settings.write_text(content)
    with pytest.raises(BadSettings) as caught:
        load_settings()
    assert str(isolated_settings) in str(caught.value)
    assert words in str(caught.value)


@pytest.mark.parametrize(("declared", "shown"), [("0", "0 bytes"), ("12", "12 bytes")])
def test_a_declared_ram_no_machine_has_is_refused_saying_to_write_its_unit(
    monkeypatch, declared, shown
):
    """Guards against FLUKSIO_RAM=0 or a bare 12 (meant as 12 GB) clamping every ram= to
    nothing and dropping its budget without a word."""
    monkeypatch.setenv("FLUKSIO_RAM", declared)
    with pytest.raises(BadSettings) as caught:
        load_settings()
    said = str(caught.value)
    assert f"FLUKSIO_RAM={declared!r}" in said and shown in said, said
    assert "such as 16G" in said, said


def test_a_bad_environment_variable_names_itself(monkeypatch):
    monkeypatch.setenv("FLUKSIO_GPUS", "two")
    with pytest.raises(BadSettings) as caught:
        load_settings()
    assert "FLUKSIO_GPUS='two'" in str(caught.value)


def test_gpu_ram_is_a_card_memory_budget_read_like_ram():
    wanted = parse_claim_line("gpus=1 gpu_ram=8G").resources
    assert (wanted.gpus, wanted.gpu_ram_bytes, wanted.ram_bytes) == (1, 8 * 10**9, 0)
    assert wanted.describe() == "cpus=1 gpus=1 gpu_ram=8.0GB"


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("gpus=0.5 gpu_ram=8G", "both size a slice of one card"),
        ("gpus=1 gpu_ram=eight", "gpu_ram='eight' is not a size"),
        ("gpus=1 gpu_ram=0", "gpu_ram must be more than zero bytes"),
        ("gpus=1 gpuram=8G", "did you mean 'gpu_ram'?"),
    ],
)
def test_a_bad_gpu_ram_says_what_to_change(line, words):
    with pytest.raises(BadClaim) as caught:
        parse_claim_line(line)
    assert words in str(caught.value)


def test_a_flavor_may_carry_a_card_memory_budget(isolated_settings):
    isolated_settings.write_text(
        json.dumps({"flavors": {"card": {"cpus": 2, "gpus": 1, "gpu_ram": "10G"}}})
    )
    settings_now = load_settings()
    assert resolve_flavor(Resources(flavor="card"), settings_now).gpu_ram_bytes == 10**10
    assert "10.0GB" in describe_flavors(settings_now)
    # Without one, the flavor leaves the claim's own alone.
    assert resolve_flavor(Resources(flavor="gpu-small"), settings_now).gpu_ram is None


# -----------------------------------------------------------------------------
# Slices of a card
# -----------------------------------------------------------------------------


def test_a_slice_of_a_card_is_asked_on_the_line_in_claim_and_in_a_flavor(isolated_settings):
    """Guards against gpus=0.5 or gpu_ram= alone refused anywhere a claim can be said, and
    against a slice read as whole cards (gpus=0.5 rounded to one, or to none)."""
    from fluksio_nb.card_slices import Slice

    half = parse_claim_line("gpus=0.5").resources
    assert (half.gpus, half.is_slice, half.whole_gpus) == (0.5, True, 0)
    assert half.card_ask.piece == Slice(fraction=0.5)
    alone = ask(gpu_ram="20G")
    assert alone.is_slice and alone.card_ask.piece == Slice(nbytes=20 * 10**9)
    whole = ask(gpus=1, gpu_ram="20G")
    assert not whole.is_slice and whole.card_ask.whole == 1
    isolated_settings.write_text(json.dumps({"flavors": {"notebook": {"gpus": 0.25}}}))
    flavored = resolve_flavor(parse_claim_line("flavor=notebook").resources, load_settings())
    assert flavored.card_ask.piece == Slice(fraction=0.25)
