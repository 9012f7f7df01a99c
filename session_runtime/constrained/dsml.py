"""DeepSeek V3.2's DSML call arguments as a structural tag: one parameter
element per property in the schema's order, as templates/deepseek.py writes
them (`string="true"` and the raw text for a string property, `string="false"`
and JSON for any other), required ones always, optional ones maybe.

xgrammar's own `deepseek_xml` style admits whitespace runs between and inside
the elements and JSON where DeepSeek writes raw text, which the template's
parser then reads differently; this grammar admits only what the parser reads
back as the arguments, with `｜DSML｜` as the one token the model writes it as.
"""

from __future__ import annotations

from typing import Callable, Optional

DSML = "｜DSML｜"


def arguments(schema: dict, json_value: Callable[[object], dict], dsml_token: Optional[int] = None) -> list[dict]:
    """The formats of an invoke's parameters for `schema` (an object schema);
    `json_value(subschema)` is the format of a JSON value; `dsml_token`: the
    id of `｜DSML｜` where the tokenizer has it as one added token (written as
    that token, as the model writes it, never spelled in pieces)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict) or not props:
        return []
    required = set(schema.get("required") or ())
    out: list[dict] = []
    for i, (name, sub) in enumerate(props.items()):
        element = _parameter(name, sub if isinstance(sub, dict) else {}, json_value, dsml_token)
        if i:
            element = {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, element]}
        out.append(element if name in required else {"type": "optional", "content": element})
    return out


def _parameter(name: str, schema: dict, json_value: Callable[[object], dict], dsml_token: Optional[int]) -> dict:
    """`<｜DSML｜parameter name=... string=...>value</｜DSML｜parameter>`."""
    raw = schema.get("type") == "string"
    if raw:
        choices = schema.get("enum") if isinstance(schema.get("enum"), list) else (
            [schema["const"]] if isinstance(schema.get("const"), str) else None)
        if choices:
            content = {"type": "or", "elements": [{"type": "const_string", "value": v} for v in choices]}
        else:
            content = {"type": "regex", "pattern": _raw_text(schema)}
    else:
        content = json_value(schema)
    return {"type": "sequence", "elements": [
        *_markup("<", f'parameter name="{name}" string="{"true" if raw else "false"}">', dsml_token),
        content, *_markup("</", "parameter>", dsml_token)]}


def _raw_text(schema: dict) -> str:
    """A raw string value as a regex: without `</` (where the closing markup
    starts); with a length bound (minLength, maxLength), without `<` at all.
    A regex, not xgrammar's `any_text`: a grammar holding any_text takes
    xgrammar 0.2.7 about 0.2 s a token to mask wherever it runs free before it
    (the reasoning block, where SGLang follows the whole tag)."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        return f"[^<]{{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}"
    return "([^<]|<[^/])*"


def _markup(before: str, after: str, dsml_token: Optional[int]) -> list[dict]:
    """`before｜DSML｜after`, the marker as its token where it is one."""
    if dsml_token is None:
        return [{"type": "const_string", "value": before + DSML + after}]
    return [{"type": "const_string", "value": before}, {"type": "token", "token": dsml_token},
            {"type": "const_string", "value": after}]
