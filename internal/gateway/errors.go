package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// apiError is an error in OpenAI's shape, with its HTTP status.
type apiError struct {
	Status  int
	Type    string
	Code    string
	Param   string
	Message string
	// RetryAfter is the Retry-After of a 429 or 503 (0: one second).
	RetryAfter time.Duration
}

func (e *apiError) Error() string { return e.Message }

var (
	errTooLarge    = &apiError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error", Code: "request_too_large"}
	errUnauth      = &apiError{Status: http.StatusUnauthorized, Type: "invalid_request_error", Code: "invalid_api_key", Message: "missing or invalid API key"}
	errNoReplica   = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "no_replica", Message: "no healthy replica can take the request"}
	errUpstream    = &apiError{Status: http.StatusBadGateway, Type: "server_error", Code: "upstream_error"}
	errUpstreamTO  = &apiError{Status: http.StatusGatewayTimeout, Type: "server_error", Code: "upstream_timeout"}
	errMethod      = &apiError{Status: http.StatusMethodNotAllowed, Type: "invalid_request_error", Code: "method_not_allowed"}
	errNotFound    = &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "not_found", Message: "no such endpoint"}
	errModel       = &apiError{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found"}
	errBreaker     = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "breaker_open", Message: "the replica's circuit breaker is half-open with a trial request in flight"}
	errDraining    = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "shutting_down", Message: "the gateway is shutting down; send the request to another instance"}
	errBodyMemory  = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "overloaded", Message: "the gateway holds as many request bodies as its max_body_memory allows; retry later"}
	errTimeout     = &apiError{Status: http.StatusGatewayTimeout, Type: "server_error", Code: "request_timeout"}
	errContentType = &apiError{Status: http.StatusUnsupportedMediaType, Type: "invalid_request_error", Code: "unsupported_media_type",
		Message: "send the request body as application/json (curl: -H 'Content-Type: application/json'; -d alone sends a form's type)"}
	// errHolderDown: the replica holding a stored response (passthrough.go)
	// is out of rotation (health check failing, breaker open); no other has it.
	errHolderDown = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "replica_unavailable", Message: "the replica holding the response named is out of rotation; retry later"}
	// errBadPath: a request path that does not name one resource plainly
	// (checkPath: dot segments, //, encoded / ? # % or control characters).
	errBadPath = &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "invalid_path"}
	// errUnknownPath: a path outside the gateway's own and the passthrough
	// allow-list (passthrough.go).
	errUnknownPath = errNotFound.with("no such endpoint: the gateway serves the OpenAI API paths it knows, " +
		"and other replica paths only when its passthrough: list opts them in")
	// errAdminOff: an admin or debug path (/debug/*, /admin/*, /ui) while
	// no admin token is configured: the endpoints do not exist (404), and
	// the message says how to make them.
	errAdminOff = errNotFound.with("no such endpoint: the admin and debug endpoints (/debug/route, /admin/replicas, /ui) " +
		"are off; start kvgate serve with --admin-token TOKEN (or $KVGATE_ADMIN_TOKEN, or admin_token: in the config) to turn them on")
	// The control plane not ready (control_plane.go): /ready's answers.
	errWarmingUp = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "warming_up",
		Message: "the gateway is loading the shared routing state; retry shortly"}
	errProbingReplicas = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "probing_replicas",
		Message: "the gateway is checking its replicas' health for the first time; retry shortly"}
)

// with returns a copy of e with a message.
func (e *apiError) with(msg string) *apiError {
	c := *e
	c.Message = msg
	return &c
}

// isAPIError reports whether err is (a message variant of) the API error e.
func isAPIError(err error, e *apiError) bool {
	var ae *apiError
	return errors.As(err, &ae) && ae.Status == e.Status && ae.Code == e.Code
}

// toAPIError maps an error to its HTTP form: the one place that does. An
// upstream error's own text (addresses, syscalls) stays in the logs.
func toAPIError(err error) *apiError {
	var ae *apiError
	var re *prompt.RequestError
	var se *router.ShedError
	var ne net.Error
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.Is(err, ui.ErrNotFound):
		return errNotFound
	case errors.Is(err, ui.ErrMethod):
		return errMethod.with(err.Error())
	case errors.Is(err, ui.ErrUnauthorized), errors.Is(err, ui.ErrWrongToken):
		return errUnauth.with(err.Error())
	case errors.As(err, &re):
		return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: re.Param, Message: re.Error()}
	case errors.As(err, &se):
		return shedError(se)
	case errors.Is(err, policy.ErrNoReplica):
		return errNoReplica
	case errors.Is(err, router.ErrModelNotServed):
		return errModel.with("The model does not exist.")
	case errors.Is(err, errRequestTimeout):
		return errTimeout.with("the request took longer than the gateway's request_timeout")
	case errors.Is(err, errDrained):
		return errDraining
	case errors.Is(err, errWarming):
		return errWarmingUp
	case errors.Is(err, errProbing):
		return errProbingReplicas
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return errUpstreamTO.with("the replica did not answer in time")
	default:
		return errUpstream.with("the replica failed before answering")
	}
}

type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	} `json:"error"`
}

func (e *apiError) body() []byte {
	var b errorBody
	b.Error.Message, b.Error.Type, b.Error.Code = e.Message, e.Type, e.Code
	if e.Param != "" {
		b.Error.Param = &e.Param
	}
	out, _ := json.Marshal(b)
	return out
}

// retryAfter is d in whole seconds, rounded up, at least 1 (RFC 9110
// §10.2.3's delay-seconds).
func retryAfter(d time.Duration) string {
	return strconv.FormatInt(max(int64((d+time.Second-1)/time.Second), 1), 10)
}

// shedMessages word the flow controller's refusals (router.ShedError).
var shedMessages = map[string]string{
	router.ShedQueueFull: "the gateway's queue for this priority is full",
	router.ShedTTL:       "the request would wait in the gateway's queue longer than its priority's time to live",
	router.ShedDeadline:  "the request's first token cannot come before its " + headerDeadline + " deadline",
	router.ShedSaturated: "the replicas are saturated and this priority is sheddable",
	router.ShedDisplaced: "a more urgent request took this one's place in the gateway's full queue",
}

// shedError is a flow-control refusal in its HTTP form: 429, with the
// controller's estimate of when to retry.
func shedError(se *router.ShedError) *apiError {
	msg, ok := shedMessages[se.Reason]
	if !ok {
		msg = "the gateway's flow control refused the request"
	}
	return &apiError{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "shed_" + se.Reason,
		Message: msg + "; retry later", RetryAfter: se.RetryAfter}
}

func writeError(w http.ResponseWriter, err error) *apiError {
	return writeErrorAs(w, err, (*apiError).body)
}

// writeErrorAs writes err's answer with its body in the shape body makes.
func writeErrorAs(w http.ResponseWriter, err error, body func(*apiError) []byte) *apiError {
	ae := toAPIError(err)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if ae.Status == http.StatusServiceUnavailable || ae.Status == http.StatusTooManyRequests {
		h.Set("Retry-After", retryAfter(ae.RetryAfter))
	}
	w.WriteHeader(ae.Status)
	_, _ = w.Write(append(body(ae), '\n'))
	return ae
}

// Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) has
// its own error shape, which Anthropic's SDKs and Claude Code read:
//
//	{"type": "error", "error": {"type": "not_found_error", "message": "..."}, "request_id": "..."}
//
// with the error type named by the status (docs.claude.com/en/api/errors).
// The gateway's own errors on those paths take that shape, with the same
// status codes; a replica's own answers pass as they are.

// isMessagesPath reports whether path is the Messages API's.
func isMessagesPath(path string) bool {
	return path == "/v1/messages" || strings.HasPrefix(path, "/v1/messages/")
}

// anthropicType is Anthropic's error type for an HTTP status.
func anthropicType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "invalid_request_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusServiceUnavailable, 529:
		return "overloaded_error"
	case http.StatusGatewayTimeout:
		return "timeout_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error" // Anthropic's for the other 4xx
}

// anthropicBody is e in Anthropic's shape; requestID "" leaves it out.
func (e *apiError) anthropicBody(requestID string) []byte {
	var b struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
		RequestID string `json:"request_id,omitempty"`
	}
	b.Type, b.Error.Type, b.Error.Message, b.RequestID = "error", anthropicType(e.Status), e.Message, requestID
	out, _ := json.Marshal(b)
	return out
}

// writeErrorFor writes err's answer to request r (bodyFor).
func writeErrorFor(w http.ResponseWriter, r *http.Request, err error) *apiError {
	if !isMessagesPath(r.URL.Path) {
		return writeError(w, err)
	}
	id := w.Header().Get("X-Request-Id")
	return writeErrorAs(w, err, func(e *apiError) []byte { return e.bodyFor(r.URL.Path, id) })
}

// bodyFor is e's answer to a request for path: in Anthropic's shape on
// the Messages API's paths (requestID: its request_id, "" none), else
// OpenAI's.
func (e *apiError) bodyFor(path, requestID string) []byte {
	if isMessagesPath(path) {
		return e.anthropicBody(requestID)
	}
	return e.body()
}
