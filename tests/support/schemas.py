"""A small JSON schema the CLI and server tests constrain a tiny model's answer to, and its check by hand (the
tests do not depend on jsonschema)."""

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def check_person(value) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
