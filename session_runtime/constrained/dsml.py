"""DeepSeek V3.2's DSML call arguments as a structural tag: one parameter
element per property in the schema's order, as templates/deepseek.py writes
them (`string="true"` and the raw text for a string property, `string="false"`
and JSON for any other), required ones always, optional ones maybe.

xgrammar's own `deepseek_xml` style admits whitespace runs between and inside
the elements and JSON where DeepSeek writes raw text, which the template's
parser then reads differently; this grammar admits only what the parser reads
back as the arguments.
"""

from __future__ import annotations

from typing import Callable

DSML = "｜DSML｜"
_END = f"</{DSML}parameter>"


def arguments(schema: dict, json_value: Callable[[object], dict]) -> list[dict]:
    """The formats of an invoke's parameters for `schema` (an object schema);
    `json_value(subschema)` is the format of a JSON value."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        return []
    required = set(schema.get("required") or ())
    out: list[dict] = []
    for i, (name, sub) in enumerate(props.items()):
        element = _parameter(name, sub if isinstance(sub, dict) else {}, json_value)
        if i:
            element = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, element]}
        out.append(element if name in required else {"type": "optional", "content": element})
    return out


def _parameter(name: str, schema: dict, json_value: Callable[[object], dict]) -> dict:
    if schema.get("type") == "string":
        begin = f'<{DSML}parameter name="{name}" string="true">'
        choices = schema.get("enum") if isinstance(schema.get("enum"), list) else (
            [schema["const"]] if isinstance(schema.get("const"), str) else None)
        if choices:
            content = {"type": "or", "elements": [{"type": "const_string", "value": v} for v in choices]}
        else:
            content = {"type": "any_text", "excludes": [_END]}
            if isinstance(schema.get("maxLength"), int):
                content["max_chars"] = schema["maxLength"]
    else:
        begin = f'<{DSML}parameter name="{name}" string="false">'
        content = json_value(schema)
    return {"type": "tag", "begin": begin, "content": content, "end": _END}
