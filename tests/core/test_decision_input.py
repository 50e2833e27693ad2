"""Decision files as people and spreadsheets make them, read by ``airflow_resumable.decision_input``: what
is read normally, and what is refused with one line saying what is wrong and what to do (no journal
here; tests/faces/test_cli.py runs the same files through ``resolve --file`` on both engines)."""

from __future__ import annotations

import json

import pytest

from airflow_resumable.decision_input import (
    DISPLAY_ONLY_FIELDS,
    MAX_JSON_DEPTH,
    DecisionInputError,
    check_text,
    check_version,
    read_decisions,
    short_version,
)
from airflow_resumable.exceptions import ResolutionError
from airflow_resumable.journal.records import version_matches

pytestmark = pytest.mark.core

BOM = b"\xef\xbb\xbf"
ENTRY = {"job_id": "j", "item_id": "b", "step": "notify", "decision": "not_delivered"}
CSV = b"job_id,item_id,step,decision\r\nj,b,notify,not_delivered\r\n"


def refused(data: bytes, *names: str) -> str:
    with pytest.raises(DecisionInputError) as info:
        read_decisions(data, "--file d")
    message = str(info.value)
    assert message.startswith("--file d: ") and "\n" not in message and len(message) < 300, message
    for name in names:
        assert name in message, message
    return message


@pytest.mark.parametrize("data", [json.dumps([ENTRY]).encode(), CSV], ids=["json", "csv"])
def test_a_byte_order_mark_is_read_as_the_start_of_the_file(data):
    assert read_decisions(BOM + data, "--file d") == read_decisions(data, "--file d") == [ENTRY]


def test_a_bad_decision_file_is_a_refused_resolution_and_a_value_error():
    # Every surface already answers ResolutionError as a refusal (the CLI exits 1, the page a 4xx).
    assert issubclass(DecisionInputError, ResolutionError) and issubclass(DecisionInputError, ValueError)


def test_a_csv_naming_a_column_twice_is_refused_naming_it():
    # csv.DictReader would apply the last one: here that would turn "delivered" into "not_delivered".
    refused(b"job_id,item_id,step,decision,receipt,decision\nj,b,notify,delivered,r-1,not_delivered\n",
            "'decision' appears twice", "keep one")


def test_a_json_object_naming_a_field_twice_is_refused_naming_the_entry():
    twice = '[{"job_id": "j", "item_id": "a", "step": "notify", "decision": "not_delivered"}, ' \
            '{"job_id": "j", "item_id": "b", "step": "notify", "decision": "delivered", "decision": "not_delivered"}]'
    refused(twice.encode(), "entry 2", "'decision' twice")


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000, 1_000_000])
def test_json_nested_past_the_limit_is_refused_without_running_out_of_stack(depth):
    refused(("[" * depth + "]" * depth).encode(), f"nested more than {MAX_JSON_DEPTH} levels")
    refused(('[{"note": ' + "{\"x\": " * depth + "1" + "}" * depth + "}]").encode(), "nested")


def test_a_number_past_pythons_digit_limit_is_refused_not_a_traceback():
    refused(('[{"job_id": "j", "item_id": "a", "decision": "not_delivered", "note": ' + "9" * 5000 + "}]").encode(),
            "a number in it has too many digits")


def test_json_up_to_the_limit_and_brackets_inside_strings_are_read():
    nested = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)  # in a list in an object in the list
    note = '[[[[{{{{ \\" [[[[ ' * 50  # brackets and escaped quotes inside a string count for nothing
    data = f'[{{"job_id": "j", "deep": {nested}, "note": "{note}"}}]'.encode()
    (entry,) = read_decisions(data, "--file d")
    assert entry["note"] == note.replace('\\"', '"') and isinstance(entry["deep"], list)


@pytest.mark.parametrize(("data", "names"), [
    (b'[{"job_id": "j", "note": "\\ud800"}]', ("entry 1", "'note'", "lone surrogate")),
    (b'[{"job_id": "j\\udfff", "note": ""}]', ("entry 1", "'job_id'", "lone surrogate")),
    (b'[{"job_id": "j", "n\\ud800": "x"}]', ("entry 1", "field name", "lone surrogate")),
    (b'[{"job_id": "j", "note": "a\\u0000b"}]', ("entry 1", "'note'", "NUL")),
])
def test_nul_and_lone_surrogates_are_refused_naming_the_entry_and_field(data, names):
    refused(data, *names)


def test_a_surrogate_pair_is_one_character_and_is_read():
    (entry,) = read_decisions(b'[{"job_id": "j", "note": "\\ud83d\\ude00"}]', "--file d")
    assert entry["note"] == "\N{GRINNING FACE}"


@pytest.mark.parametrize(("data", "names"), [
    ("job_id,note\nj,café\n".encode("latin-1"), ("not UTF-8", "byte 17", "save it as UTF-8")),
    (CSV.decode().encode("utf-16"), ("UTF-16", "save it as UTF-8")),
    (json.dumps([ENTRY]).encode("utf-16-be"), ("line 1 contains a NUL", "save the file as UTF-8")),
    (b"job_id,note\nj,a\x00b\n", ("line 2 contains a NUL",)),
])
def test_text_that_is_not_utf8_is_refused_saying_how_to_save_it(data, names):
    refused(data, *names)


def test_what_held_json_prints_only_for_people_is_dropped_and_any_other_field_kept():
    held = {"job_id": "j", "item_id": "b", "step": "notify", "reason": "unknown_outcome", "generation": 0,
            "version": "6c638f9c2414b585", "idempotency_key": "rsm1-abc", "decision": "not_delivered"}
    assert DISPLAY_ONLY_FIELDS == {"reason", "generation", "idempotency_key"}
    assert read_decisions(json.dumps([held]).encode(), "--file d") == [
        {"job_id": "j", "item_id": "b", "step": "notify", "version": "6c638f9c2414b585", "decision": "not_delivered"}]
    # A field nobody prints is kept, for the journal to refuse by name (a typo must not vanish).
    (entry,) = read_decisions(json.dumps([{**ENTRY, "recipt": "r-1"}]).encode(), "--file d")
    assert entry["recipt"] == "r-1"


def test_blank_spreadsheet_rows_are_skipped_and_a_row_with_extra_cells_is_refused():
    assert read_decisions(CSV + b",,,\r\n\r\n , ,,\r\n", "--file d") == [ENTRY]
    refused(CSV + b"j,c,notify,not_delivered,oops\r\n", "line 3", "more cells than the header")


@pytest.mark.parametrize(("data", "names"), [
    (b'[{"job_id": "j",}]', ("not valid JSON", "line 1")),
    (b'{"resolutions": []}', ("expected a JSON list",)),
])
def test_json_that_is_not_a_list_of_decisions_is_refused(data, names):
    refused(data, *names)


def test_a_version_is_given_whole_or_as_the_short_form_tables_show():
    version = "6c638f9c2414b585"
    assert short_version(version) == "6c638f9c"
    assert check_version(" 6c638f9c ") == "6c638f9c"
    with pytest.raises(DecisionInputError, match="too short.*at least its first 8 characters"):
        check_version("6c638f9")
    refused(json.dumps([{**ENTRY, "version": "6c63"}]).encode(), "entry 1: version", "too short")
    assert version_matches("6c638f9c", version)  # it starts the row's version: it stands for it
    assert version_matches("6c638f9c24", version) and version_matches(version, version)
    assert not version_matches("0211fe90", version)  # another: the journal refuses it as changed
    assert not version_matches("6c638f9", version) and not version_matches(version + "0", version)


def test_an_argument_whose_bytes_were_not_utf8_is_refused_naming_it():
    with pytest.raises(DecisionInputError, match="^item_id contains a lone surrogate"):
        check_text("b\udc80", "item_id")  # how Python hands over the byte 0x80 of an argument
    with pytest.raises(DecisionInputError, match="^--note contains a NUL"):
        check_text("a\x00", "--note")
    assert check_text("ok \N{GRINNING FACE}", "--note") == "ok \N{GRINNING FACE}"
