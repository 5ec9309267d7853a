package kvevents

import (
	"net"
	"strconv"
	"strings"
)

// OffsetPort is the endpoint data-parallel rank k of a vLLM server uses
// when it is configured with endpoint: vLLM gives rank k the port + k (and
// an ipc path the suffix _dpK), for its publisher and its replay socket
// alike. Rank 0, an empty endpoint and one without a port are unchanged.
func OffsetPort(endpoint string, k int) string {
	if endpoint == "" || k == 0 {
		return endpoint
	}
	if path, ok := strings.CutPrefix(endpoint, "ipc://"); ok {
		return "ipc://" + path + "_dp" + strconv.Itoa(k)
	}
	rest, ok := strings.CutPrefix(endpoint, "tcp://")
	if !ok {
		return endpoint
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return endpoint
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return endpoint
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+k))
}
