-- BalanceRoute for HAProxy (2.6+, Lua 5.3 with core.httpclient): an `http-request` action that
-- asks br-decision (or br-all) which rank serves the request over the HTTP/JSON API
-- (`POST /v1/assign`), passes the request id in `X-Request-Id`, and routes to the rank's shim:
-- it sets txn.balanceroute_ip / txn.balanceroute_port for `set-dst` / `set-dst-port` on a
-- `server ... 0.0.0.0:0` and prefixes the path with the endpoint's (`/rank/N`); and a filter
-- that sends `POST /v1/cancel` when the client goes away before the whole answer.
--
--   lua-load /usr/local/share/balanceroute/gateways/haproxy/balanceroute.lua
--   filter lua.balanceroute_cancel
--   http-request lua.balanceroute_assign 127.0.0.1:8063 default 2s
--
-- Arguments: br-decision's --http-listen address (an IP address: core.httpclient resolves no
-- names), the group when the request has no X-BalanceRoute-Group header, and the deadline
-- Assign may wait for a place (X-Request-Timeout; "2s", "500ms").
--
-- The output-length hints Assign takes (as the Envoy ext_proc front end reads them):
--   max_tokens              the body's `max_completion_tokens`, else its `max_tokens`
--   expected_output_tokens  the X-BalanceRoute-Expected-Output-Tokens header, else the body's
--                           `nvext.agent_hints.osl`
--   request_class           the X-Gateway-Inference-Objective header
-- The body is read with `option http-buffer-request` (what fits HAProxy's buffer,
-- tune.bufsize); a body that is not a whole JSON object, or lacks the field, gives none.
-- Values go to decision as the request has them; one decision cannot take (not a count, out of
-- 1..=10,000,000, the expected output above max_tokens, a bad class) is refused with its 400
-- INVALID_ARGUMENT, which the client gets like any other Assign error.
--
-- When Assign fails the client gets its error at once: the status br-decision answered (503 no
-- rank can take it, 504 deadline, 429 pool full) or 503 DECISION_UNREACHABLE, with
-- X-BalanceRoute-Error naming the code and a {"code", "message"} body. There is no fallback to
-- a random rank.
--
-- Cancel: an action runs once, before the request leaves, so the filter does it. It is told
-- when the answer has gone out whole (`http_end`) and when the answer's analysis ends
-- (`end_analyze`, also when the client left: during Assign, HAProxy aborts the action, or
-- mid-stream). Ended without the whole answer, or with a status of 400 or more (or an answer
-- HAProxy made itself, a 502 or 503), the request is cancelled from a task (a filter may not
-- wait on the network): WITHDRAWN while Assign waited in decision's pool, RELEASED once placed,
-- NOT_FOUND if the shim had already ended it when HAProxy closed its connection, which is
-- harmless.
local cjson = require("cjson.safe")

-- "2s", "500ms", "1m" as milliseconds; nil otherwise.
local function duration_ms(s)
    local n, unit = tostring(s):match("^(%d+)%s*(%a+)$")
    local scale = ({ ms = 1, s = 1000, m = 60000 })[unit]
    if not n or not scale then
        return nil
    end
    return tonumber(n) * scale
end

-- `placed`: Assign did place the request (its answer was unusable), so the filter still
-- cancels it; every other rejection has nothing in decision to cancel.
local function reject(txn, status, code, message, placed)
    core.Warning("balanceroute: " .. message)
    if not placed then
        txn:set_var("txn.balanceroute_settled", 1)
    end
    local reply = txn:reply({
        status = status,
        headers = {
            ["content-type"] = { "application/json" },
            ["x-balanceroute-error"] = { code },
        },
        body = cjson.encode({ code = code, message = "balanceroute: " .. message }),
    })
    txn:done(reply)
end

local function first_header(hdrs, name)
    local h = hdrs[name]
    return h and h[0]
end

-- The prompt's token count: X-BalanceRoute-Prompt-Tokens, else a rough estimate from the body's
-- length (4 bytes a token); the shim replaces it with the engine's count once it knows it.
local function prompt_tokens(hdrs, body)
    local n = tonumber(first_header(hdrs, "x-balanceroute-prompt-tokens") or "")
    if n and n >= 1 then
        return math.floor(n)
    end
    local len = tonumber(first_header(hdrs, "content-length") or "") or (body and #body) or 0
    return math.max(1, math.floor(len / 4))
end

-- The output-length hints of a request (see the top of this file): `hdrs` its headers, `body`
-- its body as buffered (nil when none).
local function hints(hdrs, body)
    local h = {}
    local len = tonumber(first_header(hdrs, "content-length") or "")
    -- A body longer than the buffer is cut short: no JSON to read.
    local whole = body and body ~= "" and (not len or #body >= len)
    local doc = whole and cjson.decode(body)
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
    local expected = first_header(hdrs, "x-balanceroute-expected-output-tokens")
    if expected then
        h.expected_output_tokens = expected:match("^%s*(.-)%s*$")
    end
    local class = first_header(hdrs, "x-gateway-inference-objective")
    if class and class ~= "" then
        h.request_class = class
    end
    return h
end

-- `POST <path>` of `payload` as JSON to decision's HTTP/JSON port, with `headers` beside the
-- content type; the httpclient's answer (nil or status 0 when it got none).
local function post(decision, path, payload, timeout_ms, headers)
    headers = headers or {}
    headers["content-type"] = { "application/json" }
    local body, err = cjson.encode(payload)
    if not body then
        return nil, err
    end
    return core.httpclient():post({
        url = "http://" .. decision .. path,
        headers = headers,
        body = body,
        timeout = timeout_ms,
    })
end

local function assign(txn, decision, default_group, timeout)
    local hdrs = txn.http:req_get_headers()
    local group = first_header(hdrs, "x-balanceroute-group") or default_group
    local id = first_header(hdrs, "x-request-id")
    if not id or id == "" then
        -- HAProxy's own unique id (unique-id-format), else one from the stream's counters.
        id = txn.f:unique_id()
        if not id or id == "" then
            id = string.format("hap-%x-%x", txn.f:date(), math.random(0, 0x7fffffff))
        end
    end
    -- Known to the filter from here on, so a client that leaves while Assign waits is cancelled.
    txn:set_var("txn.balanceroute_decision", decision)
    txn:set_var("txn.balanceroute_group", group)
    txn:set_var("txn.balanceroute_request_id", id)
    local wait_ms = (duration_ms(timeout) or 2000) + 1000
    local body = txn.f:req_body()
    local payload = { group = group, request_id = id, prompt_tokens = prompt_tokens(hdrs, body) }
    for k, v in pairs(hints(hdrs, body)) do
        payload[k] = v
    end
    local res, eerr = post(decision, "/v1/assign", payload, wait_ms,
        { ["x-request-timeout"] = { timeout } })
    if eerr then
        -- A body value that is no JSON number for cjson (an infinite one).
        return reject(txn, 400, "INVALID_ARGUMENT", "/v1/assign: cannot encode the request: "
            .. tostring(eerr))
    end
    local status = res and tonumber(res.status) or 0
    if status == 0 then
        return reject(txn, 503, "DECISION_UNREACHABLE",
            "decision at " .. decision .. " is unreachable or did not answer within "
            .. wait_ms .. " ms")
    end
    local answer = cjson.decode(res.body or "")
    if status ~= 200 and not (type(answer) == "table" and answer.code) then
        -- Not br-decision's answer: the httpclient's own 503/504 page when it could not connect
        -- or the answer did not come in time.
        return reject(txn, 503, "DECISION_UNREACHABLE",
            "decision at " .. decision .. " is unreachable (HTTP client status " .. status .. ")")
    end
    if status ~= 200 then
        return reject(txn, status, answer.code, "/v1/assign: " .. tostring(answer.message))
    end
    local endpoint = type(answer) == "table" and answer.endpoint or nil
    local ip, port, prefix = tostring(endpoint):match("^http://([%d%.]+):(%d+)(.*)$")
    if not ip then
        return reject(txn, 502, "BAD_ANSWER",
            "Assign's endpoint is not http://<IPv4>:<port>[/path]: " .. tostring(endpoint), true)
    end
    prefix = prefix:gsub("/$", "")
    txn:set_var("txn.balanceroute_ip", ip)
    txn:set_var("txn.balanceroute_port", port)
    -- cjson decodes every JSON number as a float in Lua 5.3: 0 would print as "0.0".
    txn:set_var("txn.balanceroute_worker", string.format("%d", math.tointeger(answer.worker_id) or -1))
    txn.http:req_set_header("X-Request-Id", id)
    if prefix ~= "" then
        txn.http:req_set_path(prefix .. txn.f:path())
    end
end

core.register_action("balanceroute_assign", { "http-req" }, function(txn, decision, group, timeout)
    assign(txn, decision, group or "default", timeout or "2s")
end, 3)

local function cancel(decision, group, id)
    local res = post(decision, "/v1/cancel", { group = group, request_id = id }, 2000)
    local status = res and tonumber(res.status) or 0
    if status ~= 200 then
        core.Warning("balanceroute: cancel of " .. id .. " at " .. decision .. ": HTTP status "
            .. status .. " " .. tostring(res and res.body))
    end
end

-- One instance per stream (HAProxy calls `new` on the class).
local CancelFilter = { id = "balanceroute_cancel", flags = filter.FLT_CFG_FL_HTX }
CancelFilter.__index = CancelFilter

function CancelFilter:new()
    return setmetatable({ complete = false, sent = false, status = nil }, CancelFilter)
end

function CancelFilter:start_analyze(txn, chn)
    if chn:is_resp() then
        -- HAProxy calls http_end only on a channel whose data the filter takes part in.
        filter.register_data_filter(self, chn)
    end
    return filter.CONTINUE
end

-- Forwards the answer's data as it comes (no return value: all of it). A data filter needs this
-- callback even though it looks at no data: HAProxy 2.6 (fixed upstream in 3.2) keeps a data
-- filter's position in the body only when the filter has one, and without it reckons the
-- answer's end from a stale position, so the stream never ends and the connection stays open
-- after a whole answer (even one the client asked to close) until `timeout client`.
function CancelFilter:http_payload(txn, msg)
end

-- The answer's status, while its head is still there to read: by the end of the answer HAProxy
-- has sent it, and `status` finds nothing. An answer HAProxy makes itself (its 502 or 503, the
-- action's reply) passes no filter and leaves it unset.
function CancelFilter:http_headers(txn, msg)
    if msg.channel:is_resp() then
        self.status = tonumber(txn.f:status() or "") or 0
    end
    return filter.CONTINUE
end

function CancelFilter:http_end(txn, msg)
    if msg.channel:is_resp() then
        self.complete = true
    end
    return filter.CONTINUE
end

function CancelFilter:end_analyze(txn, chn)
    -- Only the answer's end decides: the request's analysis may end while the answer streams.
    if self.sent or not chn:is_resp() then
        return filter.CONTINUE
    end
    local id = txn:get_var("txn.balanceroute_request_id")
    if not id or txn:get_var("txn.balanceroute_settled") then
        return filter.CONTINUE
    end
    local status = self.status or 0
    if self.complete and status > 0 and status < 400 then
        return filter.CONTINUE
    end
    self.sent = true
    local decision, group = txn:get_var("txn.balanceroute_decision"), txn:get_var("txn.balanceroute_group")
    core.register_task(function()
        cancel(decision, group, id)
    end)
    return filter.CONTINUE
end

core.register_filter("balanceroute_cancel", CancelFilter, function(class)
    return class
end)
