"""/openapi.json, generated from the msgspec request and response types."""

from __future__ import annotations

from functools import lru_cache

import msgspec

from api_gateway import openai_types as H
from api_gateway.passthrough import POOLING_PATHS, SPEECH_PATHS


@lru_cache(maxsize=1)
def spec() -> dict:
    from servectl import __version__

    types = [H.CompletionRequest, H.ChatCompletionRequest, H.CompletionResponse, H.ChatCompletionResponse,
             H.ChatCompletionChunk, H.ModelList, H.ModelCard, H.ErrorResponse, H.TokenizeRequest,
             H.DetokenizeRequest]
    (schemas), components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    ref = dict(zip([t.__name__ for t in types], schemas))
    error = {"description": "error", "content": {"application/json": {"schema": ref["ErrorResponse"]}}}

    def post(req: str, resp: str, stream_resp: str) -> dict:
        return {"post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref[req]}}},
            "responses": {
                "200": {"description": "the completion (stream: text/event-stream of " + stream_resp + ")",
                        "content": {"application/json": {"schema": ref[resp]}}},
                "400": error, "401": error, "404": error, "413": error, "429": error, "503": error},
        }}

    def passthrough(what: str) -> dict:
        return {"post": {"summary": what, "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": {"description": "vLLM's body (stream: text/event-stream)"},
                          "400": error, "401": error, "404": error, "413": error, "429": error, "503": error}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "servectl", "version": __version__},
        "paths": {
            "/v1/completions": post("CompletionRequest", "CompletionResponse", "CompletionResponse"),
            "/v1/chat/completions": post("ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk"),
            "/v1/responses": passthrough("OpenAI's Responses API, answered by vLLM's OpenAIServingResponses "
                                         "(its ResponsesRequest; stream: its response.* events)"),
            "/v1/messages": passthrough("Anthropic's Messages API, answered by vLLM's AnthropicServingMessages "
                                        "(its AnthropicMessagesRequest; stream: message_start ... message_stop)"),
            "/v1/messages/count_tokens": passthrough("Anthropic's token count (AnthropicCountTokensRequest)"),
            **{path: passthrough(f"vLLM's pooling route {path} (a pooling model; its request class)")
               for path in POOLING_PATHS},
            **{path: {"post": {"summary": f"vLLM's {kind} (a speech-to-text model; multipart/form-data: file, "
                                          "model, language, prompt, response_format, temperature, ...)",
                               "requestBody": {"required": True, "content": {"multipart/form-data": {
                                   "schema": {"type": "object", "required": ["file"], "properties": {
                                       "file": {"type": "string", "format": "binary"}}}}}},
                               "responses": {"200": {"description": "vLLM's body (stream: text/event-stream)"},
                                             "400": error, "401": error, "404": error, "413": error, "429": error,
                                             "503": error}}}
               for path, kind in SPEECH_PATHS.items()},
            "/v1/models": {"get": {"responses": {"200": {"description": "served models", "content": {
                "application/json": {"schema": ref["ModelList"]}}}}}},
            "/v1/models/{model}": {"get": {
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "one model", "content": {
                    "application/json": {"schema": ref["ModelCard"]}}}, "404": error}}},
            "/tokenize": {"post": {
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref["TokenizeRequest"]}}},
                "responses": {"200": {"description": "vLLM's TokenizeResponse: count, max_model_len, tokens, "
                                                     "token_strs"}, "400": error, "401": error, "404": error}}},
            "/detokenize": {"post": {
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": ref["DetokenizeRequest"]}}},
                "responses": {"200": {"description": "vLLM's DetokenizeResponse: prompt"}, "400": error,
                              "401": error, "404": error}}},
            "/tokenizer_info": {"get": {
                "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the tokenizer's configuration (vLLM's TokenizerInfoResponse)"},
                              "401": error, "404": error}}},
            "/health": {"get": {"responses": {"200": {"description": "every model ready"},
                                              "503": {"description": "some model not ready"}}}},
            "/live": {"get": {"responses": {"200": {"description": "the gateway and its manager are alive"},
                                            "503": {"description": "the manager is gone"}}}},
            "/ready": {"get": {
                "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "this host takes new requests (for every model, or this one)"},
                              "404": error, "503": {"description": "not ready, or the host is stopping"}}}},
            "/kv_event_sources": {"get": {
                "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "replica → vLLM's KVEventsConfig (one model), or by model"},
                              "401": error, "404": error}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text format"}}}},
            "/version": {"get": {"responses": {"200": {"description": "servectl version"}}}},
            **admin_paths(error),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"adminKey": {"type": "http", "scheme": "bearer",
                                                        "description": "one of gateway.admin_keys"}}},
    }


def admin_paths(error: dict) -> dict:
    """The model-management routes (api_gateway/admin.py): they exist only with an admin key configured."""
    name = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    refused = {"401": error, "403": error, "404": error, "409": error, "503": error}
    done = {"description": "what the manager did: {model, action, done, message}", "content": {
        "application/json": {"schema": {"type": "object", "properties": {
            "model": {"type": "string"}, "action": {"type": "string"}, "done": {"type": "boolean"},
            "message": {"type": "string"}}}}}}

    def verb(summary: str, body: dict | None = None) -> dict:
        op = {"summary": summary, "security": [{"adminKey": []}], "parameters": name,
              "responses": {"200": done, **refused}}
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        return {"post": op}

    paths = {"/servectl/v1/models": {"get": {
        "summary": "every configured model: state, devices, memory held, last used, requests, restarts "
                   "(needs an admin key)",
        "security": [{"adminKey": []}],
        "responses": {"200": {"description": "{object: list, data: [model]}"}, "401": error, "403": error,
                      "404": error, "503": error}}}}
    for action, summary in (("load", "start a configured model that is not served"),
                            ("unload", "drain and stop a model (it stays configured)"),
                            ("restart", "a supervised restart of the model's engine group (requests resume)")):
        paths[f"/servectl/v1/models/{{model}}/{action}"] = verb(summary)
    paths["/servectl/v1/models/{model}/freeze"] = verb(
        "turn freezing of the model's idle workers on or off",
        {"type": "object", "required": ["enabled"], "properties": {"enabled": {"type": "boolean"}}})
    lora = {"summary": "", "security": [{"adminKey": []}],
            "responses": {"200": {"description": "vLLM's success text", "content": {"text/plain": {}}},
                          "400": error, "401": error, "403": error, "404": error, "409": error, "503": error}}
    string, boolean = {"type": "string"}, {"type": "boolean"}
    for path, summary, required, props in (
            ("/v1/load_lora_adapter", "load a LoRA adapter into a model with enable_lora (vLLM's "
             "LoadLoRAAdapterRequest; `model` names the model when several take adapters)",
             ["lora_name", "lora_path"], {"lora_name": string, "lora_path": string, "load_inplace": boolean,
                                          "model": string}),
            ("/v1/unload_lora_adapter", "stop serving a LoRA adapter (vLLM's UnloadLoRAAdapterRequest)",
             ["lora_name"], {"lora_name": string, "model": string})):
        paths[path] = {"post": {**lora, "summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"type": "object", "required": required, "properties": props}}}}}}
    return paths
