package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/prompt"
)

// APIError is an error answered to a client, in OpenAI's shape
// {"error": {"message", "type", "param", "code"}}.
type APIError struct {
	Status  int
	Type    string // OpenAI error type: invalid_request_error, server_error, ...
	Code    string // OpenAI error code, "" = null
	Param   string // the offending field, "" = null
	Message string
}

func (e *APIError) Error() string {
	return fmt.Sprintf("sim: %d %s: %s", e.Status, e.Type, e.Message)
}

// Sentinel-like constructors, one per kind of answer.
func badRequest(param, format string, args ...any) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Param: param,
		Message: fmt.Sprintf(format, args...)}
}

func modelNotFound(model string) *APIError {
	return &APIError{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "model_not_found",
		Param: "model", Message: fmt.Sprintf("The model `%s` does not exist.", model)}
}

// contextTooLong: the prompt and the completion asked for do not fit the
// context together (vLLM's check, in the sim's words). The total is summed
// in uint64: both terms are at most MaxInt64.
func contextTooLong(maxLen, promptTokens int, completion int64, where, param string) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded",
		Param: param,
		Message: fmt.Sprintf("This model's context holds %d tokens, and this request needs %d: %d in the %s "+
			"and %d for the completion. Shorten the %s or ask for fewer completion tokens.",
			maxLen, uint64(promptTokens)+uint64(completion), promptTokens, where, completion, where)}
}

// promptTooLong: the prompt alone leaves no room for a completion token.
func promptTooLong(maxLen, promptTokens int, where string) *APIError {
	return &APIError{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "context_length_exceeded",
		Param: where,
		Message: fmt.Sprintf("This model's context holds %d tokens, and the %s alone take %d, leaving no room "+
			"for the completion. Shorten the %s.", maxLen, where, promptTokens, where)}
}

var (
	errInjected = &APIError{Status: http.StatusInternalServerError, Type: "server_error",
		Message: "injected fault: internal server error"}
	errFailed = &APIError{Status: http.StatusServiceUnavailable, Type: "service_unavailable_error",
		Message: "injected fault: the replica has failed"}
	errShuttingDown = &APIError{Status: http.StatusServiceUnavailable, Type: "service_unavailable_error",
		Message: "the replica is shutting down"}
)

// toAPIError maps an error to its answer, in one place.
func toAPIError(err error) *APIError {
	var ae *APIError
	var re *prompt.RequestError
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &re):
		return badRequest(re.Param, "%s", re.Msg)
	case errors.As(err, &mbe):
		return &APIError{Status: http.StatusRequestEntityTooLarge, Type: "invalid_request_error",
			Message: fmt.Sprintf("request body larger than %d bytes", mbe.Limit)}
	case errors.Is(err, engine.ErrInvalidRequest):
		return badRequest("", "%v", err)
	}
	return &APIError{Status: http.StatusInternalServerError, Type: "server_error", Message: err.Error()}
}

func writeError(w http.ResponseWriter, err error) {
	ae := toAPIError(err)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(ae.Status)
	_, _ = w.Write(ae.body())
}

// body is the error's JSON in OpenAI's shape; param and code are null when
// empty.
func (e *APIError) body() []byte {
	b := openai.ErrorBody{Error: openai.Error{Message: e.Message, Type: e.Type}}
	if e.Param != "" {
		b.Error.Param = &e.Param
	}
	if e.Code != "" {
		b.Error.Code = e.Code
	}
	data, _ := json.Marshal(b)
	return data
}
