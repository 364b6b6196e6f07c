"""A small JSON schema the CLI and server tests constrain a tiny model's answer to, and its check by hand (the
tests do not depend on jsonschema)."""


def person_schema(name_length: int = 6, max_age: int = 120) -> dict:
    """A person's name (at most `name_length` characters) and age (0..max_age), both required, nothing else."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": name_length},
            "age": {"type": "integer", "minimum": 0, "maximum": max_age},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }


PERSON = person_schema()


def check_person(value) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
