"""User JSON schemas are closed before decoding, as llama.cpp and vLLM read them: an object that lists its
properties takes no others unless it says so; merged and deliberately open schemas keep their meaning."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from engine.constraint import check_grammar
from server.json_schemas import INTEGER_LIMIT, as_llama_cpp_reads, placed_at, with_definitions
from tests.fixtures.schemas import opened, varied_schemas


def valid(instance: object, schema: dict) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize("name, schema", varied_schemas(8))
def test_schemas_written_open_are_closed_back_to_what_they_list(name, schema):
    assert as_llama_cpp_reads(opened(schema)) == schema


def test_nested_objects_and_array_items_lose_undeclared_keys():
    schema = {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string"}}},
        "stops": {"type": "array", "items": {"type": "object", "properties": {"at": {"type": "integer"}}}}}}
    closed = as_llama_cpp_reads(schema)
    assert valid({"city": {"name": "Paris", "zip": "75001"}, "stops": [{"at": 1, "why": "x"}], "extra": 1}, schema)
    assert valid({"city": {"name": "Paris"}, "stops": [{"at": 1}]}, closed)
    for extra in ({"extra": 1}, {"city": {"name": "Paris", "zip": "75001"}}, {"stops": [{"at": 1, "why": "x"}]}):
        assert not valid(extra, closed), extra


def test_schemas_that_ask_for_other_keys_keep_them():
    schemas = [
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x_": {}}},
        {"type": "object"},  # no properties listed: any object, as llama.cpp reads it
        {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]},  # closing would admit nothing
    ]
    for schema in schemas:
        assert as_llama_cpp_reads(schema) == schema


def test_merged_schemas_admit_what_they_admitted():
    base = {"type": "object", "properties": {"id": {"type": "integer"}}}
    schemas = [
        {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}}}], "$defs": {"Base": base}},
        {"$ref": "#/$defs/Base", "properties": {"name": {"type": "string"}}, "$defs": {"Base": base}},
        {"properties": {"id": {"type": "integer"}}, "anyOf": [{"properties": {"name": {}}}, {"required": ["id"]}]},
    ]
    for schema in schemas:
        closed = as_llama_cpp_reads(schema)
        assert valid({"id": 1, "name": "x"}, schema) and valid({"id": 1, "name": "x"}, closed), closed


def test_references_and_alternatives_are_closed_where_they_stand_alone():
    schema = {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "object", "properties": {"r": {"type": "number"}}}],
              "$defs": {"Point": {"type": "object", "properties": {"x": {}, "y": {}}, "required": ["x", "y"]}}}
    closed = as_llama_cpp_reads(schema)
    assert valid({"x": 1, "y": 2, "z": 3}, schema) and not valid({"x": 1, "y": 2, "z": 3}, closed)
    assert valid({"x": 1, "y": 2}, closed) and valid({"r": 1.5}, closed) and not valid({"r": 1.5, "x": 1}, closed)


def test_keywords_as_property_names_are_properties():
    schema = {"type": "object", "properties": {"properties": {"type": "string"}, "allOf": {"type": "boolean"}}}
    closed = as_llama_cpp_reads(schema)
    assert closed["properties"] == schema["properties"] and closed["additionalProperties"] is False
    assert valid({"properties": "p", "allOf": True}, closed) and not valid({"other": 1}, closed)


def test_integers_without_bounds_get_llama_cpps_sixteen_digits():
    closed = as_llama_cpp_reads({"type": "object", "properties": {
        "n": {"type": "integer"}, "maybe": {"type": ["integer", "null"]}, "from_one": {"type": "integer", "minimum": 1}}})
    assert valid({"n": INTEGER_LIMIT, "maybe": -INTEGER_LIMIT, "from_one": INTEGER_LIMIT}, closed)
    assert INTEGER_LIMIT == int("9" * 16)
    for too_long in ({"n": INTEGER_LIMIT + 1}, {"maybe": -INTEGER_LIMIT - 1}, {"from_one": 10**16}, {"from_one": 0}):
        assert not valid(too_long, closed), too_long
    assert valid({"maybe": None}, closed)


def test_integer_ranges_already_bounded_or_beyond_the_digits_stay_as_they_are():
    schemas = [
        {"type": "integer", "minimum": -5, "maximum": 5},
        {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        {"type": "integer", "enum": [10**20, 1]},
        {"type": "integer", "const": 10**20},
        {"type": "number"},  # llama.cpp caps its digits too, but a schema cannot say so
        {"type": ["integer", "number"]},
    ]
    for schema in schemas:
        assert as_llama_cpp_reads(schema) == schema
    above = {"type": "integer", "minimum": 10**17}  # a maximum of 16 digits would leave nothing
    assert as_llama_cpp_reads(above) == above
    below = {"type": "integer", "maximum": -(10**17)}
    assert as_llama_cpp_reads(below) == below


def test_the_request_schema_is_left_as_it_came():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    before = copy.deepcopy(schema)
    as_llama_cpp_reads(schema)
    assert schema == before


def test_closed_schemas_compile_as_grammars():
    schema = as_llama_cpp_reads({"type": "object", "properties": {"a": {"type": "integer"}, "b": {
        "type": "array", "items": {"type": "object", "properties": {"c": {"type": "string", "maxLength": 3}}}}},
        "required": ["a"]})
    check_grammar(f"start: %json {json.dumps(schema)}\n")


STOP = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ROUTE = {"type": "object", "$defs": {"Stop": STOP}, "properties": {
    "first": {"$ref": "#/$defs/Stop"}, "rest": {"type": "array", "items": {"$ref": "#/$defs/Stop"}}, "loop": {"$ref": "#"}}}


def test_a_schema_placed_inside_another_refers_into_itself_there():
    call = {"type": "object", "properties": {"name": {"const": "route"}, "arguments": placed_at(ROUTE, "/properties/arguments")}}
    placed = call["properties"]["arguments"]
    assert placed["properties"]["first"] == {"$ref": "#/properties/arguments/$defs/Stop"}
    assert placed["properties"]["rest"]["items"] == {"$ref": "#/properties/arguments/$defs/Stop"}
    assert placed["properties"]["loop"] == {"$ref": "#/properties/arguments"}
    assert valid({"name": "route", "arguments": {"first": {"city": "Oslo"}, "loop": {"rest": [{"city": "Rome"}]}}}, call)
    assert not valid({"name": "route", "arguments": {"first": {}}}, call)  # Stop's `city` is still required
    check_grammar(f"start: %json {json.dumps(call)}\n")


def test_a_parameter_used_on_its_own_takes_the_definitions_it_refers_to():
    first = with_definitions(ROUTE["properties"]["first"], ROUTE)
    assert first == {"$ref": "#/$defs/Stop", "$defs": {"Stop": STOP}}
    assert valid({"city": "Oslo"}, first) and not valid({}, first)
    check_grammar(f"start: %json {json.dumps(first)}\n")
    plain = {"type": "integer"}
    assert with_definitions(plain, ROUTE) is plain  # no reference: nothing added
