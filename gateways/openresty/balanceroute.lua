-- BalanceRoute for OpenResty-style gateways (nginx with lua-nginx-module, OpenResty, Kong,
-- APISIX): before each LLM request, ask br-decision (or br-all) which rank serves it over the
-- HTTP/JSON API (`POST /v1/assign`), send the request to the endpoint it answers with and the
-- request id in `X-Request-Id`, and `POST /v1/cancel` when the client goes away before the
-- answer is done, so the rank's reservation is released at once instead of by its TTL.
--
-- Two layers:
--   * `client(conf)`: `:assign(group, request_id, prompt_tokens[, hints])` and
--     `:cancel(group, id)` over cosockets (ngx.socket.tcp), usable wherever cosockets are
--     (access, content and timer contexts): a Kong or APISIX plugin calls these and sets its
--     own upstream; `request_hints()` reads the hints from the request, as the glue does;
--   * `access(conf)` / `log(conf)`: the nginx glue of gateways/openresty/nginx.conf.
--
-- Why cosockets and not ngx.location.capture or lua-resty-http: capture needs an internal
-- location in the nginx configuration, which a Kong or APISIX plugin cannot add; lua-resty-http
-- is not packaged by Debian. The request here is one small JSON POST with `Connection: close`.
--
-- Configuration (a table; every field but `decision` has a default):
--   decision         "host:port" of br-decision's --http-listen (an IP address, or a name
--                    nginx's `resolver` resolves)
--   group            the group when the request has no X-BalanceRoute-Group header ("default")
--   assign_timeout   the deadline br-decision may wait for a place, as X-Request-Timeout
--                    ("2s"); the socket waits this long plus `socket_slack_ms`
--   socket_slack_ms  1000
--   fallback         an upstream URL ("http://host:port") to use when Assign fails; nil (the
--                    default) answers the client with Assign's error instead
--   read_body        true (the default): the access phase reads the request body for its
--                    `max_tokens` and `nvext.agent_hints.osl`; false: only the headers give
--                    hints, and the body streams to the rank as it arrives
--
-- The output-length hints Assign takes (as the Envoy ext_proc front end reads them):
--   max_tokens              the body's `max_completion_tokens`, else its `max_tokens`
--   expected_output_tokens  the X-BalanceRoute-Expected-Output-Tokens header, else the body's
--                           `nvext.agent_hints.osl`
--   request_class           the X-Gateway-Inference-Objective header
-- A body that is not a JSON object, or lacks the field, gives none. Values go to decision as
-- the request has them; one decision cannot take (not a count, out of 1..=10,000,000, the
-- expected output above max_tokens, a bad class) is refused with its 400 INVALID_ARGUMENT,
-- which the client gets like any other Assign error.
local cjson = require("cjson.safe")

local M = {}

local DEFAULTS = {
    group = "default",
    assign_timeout = "2s",
    socket_slack_ms = 1000,
    read_body = true,
}

local function with_defaults(conf)
    local c = {}
    for k, v in pairs(DEFAULTS) do
        c[k] = v
    end
    for k, v in pairs(conf or {}) do
        c[k] = v
    end
    assert(type(c.decision) == "string", "balanceroute: conf.decision (host:port) is required")
    local host, port = c.decision:match("^%[?([^%]]+)%]?:(%d+)$")
    assert(host, "balanceroute: conf.decision must be host:port, got " .. c.decision)
    c.host, c.port = host, tonumber(port)
    return c
end

-- "2s", "500ms", "1m" as milliseconds (the units X-Request-Timeout accepts that a gateway
-- would use); nil for anything else.
local function duration_ms(s)
    local n, unit = tostring(s):match("^(%d+)%s*(%a+)$")
    local scale = ({ ms = 1, s = 1000, m = 60000 })[unit]
    if not n or not scale then
        return nil
    end
    return tonumber(n) * scale
end

-- A typed error: `status` is the HTTP status the gateway answers with, `code` a gRPC code
-- name (br-decision's own, or DECISION_UNREACHABLE / BAD_ANSWER for what happened here).
local function failure(status, code, message)
    return { status = status, code = code, message = message }
end

-- POSTs `body` (a table) to `path`; the decoded JSON answer, or nil and a typed error.
local function post(c, path, body, timeout_header)
    local payload, eerr = cjson.encode(body)
    if not payload then
        -- a hint that is no JSON value (a function, an infinite number): the caller's input
        return nil, failure(400, "INVALID_ARGUMENT",
            "balanceroute: " .. path .. ": cannot encode the request: " .. tostring(eerr))
    end
    local sock = ngx.socket.tcp()
    local wait_ms = (duration_ms(c.assign_timeout) or 2000) + c.socket_slack_ms
    sock:settimeouts(c.socket_slack_ms, wait_ms, wait_ms)
    local ok, err = sock:connect(c.host, c.port)
    if not ok then
        return nil, failure(503, "DECISION_UNREACHABLE",
            "balanceroute: decision at " .. c.decision .. " is unreachable: " .. tostring(err))
    end
    local lines = {
        "POST " .. path .. " HTTP/1.1",
        "Host: " .. c.decision,
        "Content-Type: application/json",
        "Content-Length: " .. #payload,
        "Connection: close",
    }
    if timeout_header then
        lines[#lines + 1] = "X-Request-Timeout: " .. timeout_header
    end
    ok, err = sock:send(table.concat(lines, "\r\n") .. "\r\n\r\n" .. payload)
    if not ok then
        sock:close()
        return nil, failure(503, "DECISION_UNREACHABLE",
            "balanceroute: sending to decision at " .. c.decision .. ": " .. tostring(err))
    end
    -- `Connection: close`: the answer is everything until the server closes.
    local raw, rerr, partial = sock:receive("*a")
    sock:close()
    raw = raw or partial
    if rerr == "timeout" then
        return nil, failure(504, "DEADLINE_EXCEEDED",
            "balanceroute: decision at " .. c.decision .. " did not answer within "
            .. wait_ms .. " ms")
    end
    local status = raw and tonumber(raw:match("^HTTP/1%.%d (%d%d%d)"))
    local answer = raw and raw:match("\r\n\r\n(.*)$")
    if not status then
        return nil, failure(503, "DECISION_UNREACHABLE",
            "balanceroute: no HTTP answer from decision at " .. c.decision .. ": "
            .. tostring(rerr))
    end
    local decoded = cjson.decode(answer or "")
    if status ~= 200 then
        -- br-decision's own error: {"code", "message"} with grpc-gateway's status.
        local code = type(decoded) == "table" and decoded.code or "UNKNOWN"
        local message = type(decoded) == "table" and decoded.message or tostring(answer)
        return nil, failure(status, code, "balanceroute: " .. path .. ": " .. tostring(message))
    end
    if type(decoded) ~= "table" then
        return nil, failure(502, "BAD_ANSWER",
            "balanceroute: " .. path .. " answered 200 without a JSON object")
    end
    return decoded
end

local Client = {}
Client.__index = Client

function M.client(conf)
    return setmetatable({ conf = with_defaults(conf) }, Client)
end

-- The hints Assign takes beside the prompt tokens.
local HINTS = { "max_tokens", "expected_output_tokens", "request_class" }

-- Assign: the answer ({worker_id, endpoint, incarnation, ...}; 64-bit integers are strings)
-- or nil and a typed error. `hints` (optional): {max_tokens=, expected_output_tokens=,
-- request_class=}, each left out when nil; decision checks them (400 INVALID_ARGUMENT).
function Client:assign(group, request_id, prompt_tokens, hints)
    local body = {
        group = group,
        request_id = request_id,
        prompt_tokens = prompt_tokens,
    }
    if type(hints) == "table" then
        for _, k in ipairs(HINTS) do
            if hints[k] ~= nil and hints[k] ~= cjson.null then
                body[k] = hints[k]
            end
        end
    end
    local a, err = post(self.conf, "/v1/assign", body, self.conf.assign_timeout)
    if not a then
        return nil, err
    end
    if type(a.endpoint) ~= "string" or a.endpoint == "" then
        return nil, failure(502, "BAD_ANSWER", "balanceroute: Assign answered without an endpoint")
    end
    return a
end

-- Cancel: the outcome's name (CANCEL_OUTCOME_RELEASED, _WITHDRAWN, _NOT_FOUND) or nil and a
-- typed error.
function Client:cancel(group, request_id)
    local r, err = post(self.conf, "/v1/cancel", { group = group, request_id = request_id }, nil)
    if not r then
        return nil, err
    end
    return r.outcome
end

-- "http://host:port/rank/3" -> "http://host:port", "/rank/3"
function M.split_endpoint(endpoint)
    local base, path = endpoint:match("^(https?://[^/]+)(.*)$")
    if not base then
        return nil
    end
    return base, (path:gsub("/$", ""))
end

-- The output-length hints of a request: `header(name)` gives a request header's value (nil
-- when absent), `body` the request body (nil when not read). Pure, so any gateway can use it.
function M.hints(header, body)
    local h = {}
    local doc = body and body ~= "" and cjson.decode(body)
    if type(doc) == "table" then
        -- The chat API's current name first, as ext_proc reads it.
        for _, k in ipairs({ "max_completion_tokens", "max_tokens" }) do
            if doc[k] ~= nil and doc[k] ~= cjson.null then
                h.max_tokens = doc[k]
                break
            end
        end
        local agent = type(doc.nvext) == "table" and doc.nvext.agent_hints
        if type(agent) == "table" and agent.osl ~= cjson.null then
            h.expected_output_tokens = agent.osl
        end
    end
    -- Headers as sent (decision reads a decimal string as a count), the header over the body.
    local expected = header("x-balanceroute-expected-output-tokens")
    if expected then
        h.expected_output_tokens = expected:match("^%s*(.-)%s*$")
    end
    local class = header("x-gateway-inference-objective")
    if class and class ~= "" then
        h.request_class = class
    end
    return h
end

-- The request body, read whole (nil when it has none): from memory, or from the temporary
-- file nginx keeps a body larger than `client_body_buffer_size` in.
local function request_body()
    ngx.req.read_body()
    local data = ngx.req.get_body_data()
    if data then
        return data
    end
    local path = ngx.req.get_body_file()
    local f = path and io.open(path, "rb")
    if not f then
        return nil
    end
    data = f:read("*a")
    f:close()
    return data
end

-- The hints of the request being served (in a phase that may read the body: rewrite or
-- access); `read_body` false: the headers' only.
function M.request_hints(read_body)
    local body = nil
    if read_body ~= false then
        body = request_body()
    end
    return M.hints(function(name)
        return ngx.var["http_" .. (name:gsub("-", "_"))]
    end, body), body
end

-- The glue for nginx.conf ------------------------------------------------------------------

local clients = {}

local function client_for(conf)
    local key = conf.decision
    local c = clients[key]
    if not c then
        c = M.client(conf)
        clients[key] = c
    end
    return c
end

local function reject(err)
    ngx.status = err.status
    ngx.header["Content-Type"] = "application/json"
    ngx.header["X-BalanceRoute-Error"] = err.code
    ngx.say(cjson.encode({ code = err.code, message = err.message }))
    return ngx.exit(err.status)
end

-- The prompt's token count: X-BalanceRoute-Prompt-Tokens, else a rough estimate from the body's
-- length (4 bytes a token); the shim replaces it with the engine's count once it knows it.
local function prompt_tokens(body)
    local n = tonumber(ngx.var.http_x_balanceroute_prompt_tokens or "")
    if n and n >= 1 then
        return math.floor(n)
    end
    local len = tonumber(ngx.var.content_length or "") or (body and #body) or 0
    return math.max(1, math.floor(len / 4))
end

-- Access phase: Assign, then point `$balanceroute_upstream` and `$balanceroute_uri` at the rank.
-- Needs `lua_check_client_abort on;`: a client that leaves while Assign waits in the pool has
-- its Assign cancelled (WITHDRAWN), or its reservation released if it was just placed.
function M.access(conf)
    local c = client_for(conf)
    local group = ngx.var.http_x_balanceroute_group or c.conf.group
    local id = ngx.var.http_x_request_id
    if not id or id == "" then
        id = ngx.var.request_id
    end
    local ctx = { group = group, request_id = id }
    ngx.ctx.balanceroute = ctx
    local ok = ngx.on_abort(function()
        ctx.done, ctx.aborted = true, true
        local outcome, cerr = c:cancel(group, id)
        if not outcome then
            ngx.log(ngx.WARN, "balanceroute: cancel of ", id, " (its client left): ", cerr.message)
        end
        ngx.exit(499)
    end)
    if not ok then
        ngx.log(ngx.WARN, "balanceroute: lua_check_client_abort is off: a client that leaves ",
            "during Assign keeps its reservation until the TTL")
    end
    local hints, body = M.request_hints(c.conf.read_body)
    local a, err = c:assign(group, id, prompt_tokens(body), hints)
    if ctx.aborted then
        -- The client left while Assign waited; the abort handler cancels it. If Assign was
        -- answered with a place at that moment, this thread's exit would kill the handler,
        -- perhaps before its Cancel left (its connect waits a round trip to a remote
        -- decision), and the reservation would stay until its TTL: cancel here too (Cancel
        -- is idempotent; whichever thread exits first, one Cancel has been answered).
        if a then
            c:cancel(group, id)
        end
        return ngx.exit(499)
    end
    if not a then
        ctx.done = true
        if c.conf.fallback then
            ngx.log(ngx.WARN, err.message, "; using the fallback ", c.conf.fallback)
            ngx.var.balanceroute_upstream = c.conf.fallback
            ngx.var.balanceroute_uri = ngx.var.request_uri
            return
        end
        ngx.log(ngx.ERR, err.message)
        return reject(err)
    end
    local base, prefix = M.split_endpoint(a.endpoint)
    if not base then
        ctx.done = true
        c:cancel(group, id)
        return reject(failure(502, "BAD_ANSWER",
            "balanceroute: Assign's endpoint is not an http URL: " .. a.endpoint))
    end
    ctx.worker_id = a.worker_id
    ngx.req.set_header("X-Request-Id", id)
    ngx.var.balanceroute_upstream = base
    ngx.var.balanceroute_uri = prefix .. ngx.var.request_uri
    ngx.header["X-BalanceRoute-Worker"] = tostring(a.worker_id)
    -- The id the rank saw (made here when the client sent none), to find the request in σ.
    ngx.header["X-Request-Id"] = id
end

local function cancel_later(premature, conf, group, id)
    if premature then
        return
    end
    local outcome, err = client_for(conf):cancel(group, id)
    if not outcome then
        ngx.log(ngx.WARN, "balanceroute: cancel of ", id, ": ", err.message)
    end
end

-- Log phase: the request did not end with the whole answer (the client left: 499, or the rank
-- could not be reached: 502/504) -> Cancel, from a timer (cosockets are unavailable here).
-- Cancelling a request the shim already ended finds nothing (NOT_FOUND), which is harmless.
function M.log(conf)
    local ctx = ngx.ctx.balanceroute
    if not ctx or ctx.done then
        return
    end
    local status = ngx.status
    local complete = ngx.var.request_completion == "OK"
    if status < 400 and complete then
        return
    end
    local ok, err = ngx.timer.at(0, cancel_later, conf, ctx.group, ctx.request_id)
    if not ok then
        ngx.log(ngx.ERR, "balanceroute: cannot schedule the cancel of ", ctx.request_id, ": ", err)
    end
end

return M
