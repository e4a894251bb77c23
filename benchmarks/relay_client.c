/*
 * relay_client.c - the C load generator of benchmarks/bench_gateway_relay.py.
 *
 * It does what the script's Python client does (_StreamClient, one_stream, run_clients),
 * with a fraction of its user-space work per SSE chunk, to take as little as it can of
 * the cores it shares with the gateway and the worker under test:
 *
 * - it opens NUM_STREAMS concurrent streamed completions to 127.0.0.1:PORT, stream k
 *   sending the one-token prompt [PROMPT_BASE_ID + k], the same request bytes as the
 *   Python client;
 * - it parses each response as its bytes arrive (status line, headers, chunked transfer
 *   encoding, SSE events split on "\n\n") and records the CLOCK_MONOTONIC time (the clock
 *   of Python's time.monotonic and of the worker's stamps) at which each token event
 *   arrived, read once per epoll_wait return as the Python client reads it once per
 *   data_received; it reads the usage event's completion_tokens and keeps error events;
 * - it writes {"start", "end", "usage", "errors", "ramp", "arrivals"} as JSON, which the
 *   script loads into the shape run_clients returns; "ramp" holds each stream's
 *   [connected, request sent, first byte read, local port] (0 where it never happened),
 *   times taken as the loop handles the event (within POLL_INTERVAL_S of it).
 *
 * Where the CPU goes: most of a client's CPU per chunk here is the kernel's, for each
 * read of a socket (TCP receive, and the ACK it sends, processed on loopback in the
 * reader's context), which any client pays; this one's own work is about 1 us a chunk.
 * Read as eagerly as possible, it woke ~100,000 times a run (1,000 streams, a token each
 * per 20 ms), which cost CPU and took the gateway's cores from it. So its loop is paced:
 * epoll_wait returns at most once per POLL_INTERVAL_S (1 ms), and an arrival time is
 * late by up to that much plus the batch's processing (the Python client's, taken as
 * its loop gets to each socket, can be tens of ms late with 1,000 streams).
 *
 * Usage: relay_client PORT NUM_STREAMS MAX_TOKENS PROMPT_BASE_ID OUT_JSON
 * Build: gcc -O2 -o relay_client relay_client.c   (plain C99 + Linux epoll)
 * Exit status: 0 once OUT_JSON is written (streams that failed are in its "errors"),
 * 1 on a fatal error (bad arguments, out of memory, epoll, the output file), 2 on usage.
 */
#define _GNU_SOURCE /* memmem */

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_EVENTS 512          /* events per epoll_wait */
#define POLL_INTERVAL_S 0.001   /* epoll_wait returns at most once per this (see above) */
#define READ_SPACE 16384        /* free bytes ensured in a stream's buffer before a read */
#define STALL_TIMEOUT_S 900.0   /* no event at all for this long: give up the open streams */
#define ERROR_MAX_CHARS 200     /* an error event is kept up to this many characters */

#define TOKEN_PREFIX "data: {\"id\""
#define ERROR_PREFIX "data: {\"error\""
#define USAGE_MARK "\"choices\":[]"
#define COMPLETION_TOKENS "\"completion_tokens\":"

/* One streamed completion. */
struct stream {
    int fd;             /* -1 once done */
    int is_connected;
    int is_head_read;   /* status line and headers parsed; the chunked body follows */
    int is_done;
    char *req;          /* the request; freed once sent */
    size_t req_len, req_sent;
    char *buf;          /* received bytes not parsed yet */
    size_t len, cap;
    double *times;      /* arrival time of each token event */
    size_t num_times, cap_times;
    long usage;         /* the usage event's completion_tokens (0 until it arrives) */
    /* The ramp (CLOCK_MONOTONIC; 0 until it happens): the connection established (the
     * first EPOLLOUT seen), the request's last byte written, the response's first byte
     * read; `port`: this end's port, the gateway's name for the connection. */
    double connected_at, sent_at, first_byte_at;
    int port;
};

static struct stream *streams;
static int num_streams, num_open;
static char **errors;   /* every stream's errors, in the order they happened */
static size_t num_errors, cap_errors;
static int epfd;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void *xrealloc(void *p, size_t size) {
    p = realloc(p, size ? size : 1);
    if (!p)
        die("realloc");
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Keep an error: printf-style text. */
static void add_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = xrealloc(NULL, (size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    if (num_errors == cap_errors) {
        cap_errors = cap_errors ? 2 * cap_errors : 64;
        errors = xrealloc(errors, cap_errors * sizeof *errors);
    }
    errors[num_errors++] = s;
}

/* The stream is over (as _StreamClient._finish, then one_stream's transport.close). */
static void finish(struct stream *s) {
    if (s->is_done)
        return;
    s->is_done = 1;
    if (s->fd >= 0)
        close(s->fd); /* also takes it out of the epoll set */
    s->fd = -1;
    free(s->req);
    free(s->buf);
    s->req = s->buf = NULL;
    s->len = s->cap = 0;
    num_open--;
}

/* Parse hex digits [p, end) into *size; 0 if they are not a valid chunk size. */
static int parse_hex(const char *p, const char *end, size_t *size) {
    size_t v = 0;
    if (p == end)
        return 0;
    for (; p < end; p++) {
        int d;
        if (*p >= '0' && *p <= '9')
            d = *p - '0';
        else if (*p >= 'a' && *p <= 'f')
            d = *p - 'a' + 10;
        else if (*p >= 'A' && *p <= 'F')
            d = *p - 'A' + 10;
        else
            return 0;
        if (v > ((size_t)1 << 40))
            return 0;
        v = v * 16 + (size_t)d;
    }
    *size = v;
    return 1;
}

static int starts_with(const char *p, size_t n, const char *prefix) {
    size_t m = strlen(prefix);
    return n >= m && memcmp(p, prefix, m) == 0;
}

/* The number of bytes of [p, p + n) that hold its first `max_chars` UTF-8 characters
 * (as Python's event.decode()[:200]). */
static size_t utf8_prefix(const char *p, size_t n, size_t max_chars) {
    size_t chars = 0, i;
    for (i = 0; i < n; i++) {
        if (((unsigned char)p[i] & 0xC0) != 0x80 && chars++ == max_chars)
            break;
    }
    return i;
}

/* One SSE event (no "\n\n"), as _StreamClient._on_chunk checks it. */
static void on_event(struct stream *s, const char *ev, size_t n, double now) {
    if (starts_with(ev, n, TOKEN_PREFIX)) {
        if (memmem(ev, n, USAGE_MARK, strlen(USAGE_MARK))) {
            const char *p = memmem(ev, n, COMPLETION_TOKENS, strlen(COMPLETION_TOKENS));
            if (p) {
                const char *end = ev + n;
                long v = 0;
                for (p += strlen(COMPLETION_TOKENS); p < end && *p == ' '; p++)
                    ;
                for (; p < end && *p >= '0' && *p <= '9'; p++)
                    v = v * 10 + (*p - '0');
                s->usage = v;
            }
        } else {
            if (s->num_times == s->cap_times) {
                s->cap_times = s->cap_times ? 2 * s->cap_times : 64;
                s->times = xrealloc(s->times, s->cap_times * sizeof *s->times);
            }
            s->times[s->num_times++] = now;
        }
    } else if (starts_with(ev, n, ERROR_PREFIX)) {
        add_error("%.*s", (int)utf8_prefix(ev, n, ERROR_MAX_CHARS), ev);
    }
}

/* One chunk's data: its events split on "\n\n". */
static void on_chunk(struct stream *s, const char *data, size_t n, double now) {
    const char *p = data, *end = data + n;
    for (;;) {
        const char *sep = memmem(p, (size_t)(end - p), "\n\n", 2);
        on_event(s, p, (size_t)((sep ? sep : end) - p), now);
        if (!sep)
            break;
        p = sep + 2;
    }
}

/* Parse what the stream's buffer holds, as _StreamClient.data_received does. */
static void parse(struct stream *s, double now) {
    char *buf = s->buf;
    size_t pos = 0;
    if (!s->is_head_read) {
        char *head_end = memmem(buf, s->len, "\r\n\r\n", 4);
        if (!head_end)
            return;
        char *line_end = memmem(buf, s->len, "\r\n", 2);
        if (!memmem(buf, (size_t)(line_end - buf), " 200 ", 5)) {
            add_error("%.*s", (int)(line_end - buf), buf);
            finish(s);
            return;
        }
        s->is_head_read = 1;
        pos = (size_t)(head_end - buf) + 4;
    }
    /* Chunked transfer encoding; one chunk per gateway write, holding whole events. */
    for (;;) {
        char *line_end = memmem(buf + pos, s->len - pos, "\r\n", 2);
        if (!line_end)
            break;
        size_t size;
        if (!parse_hex(buf + pos, line_end, &size)) {
            add_error("read: bad chunk size line: %.*s",
                      (int)(line_end - (buf + pos) < 40 ? line_end - (buf + pos) : 40),
                      buf + pos);
            finish(s);
            return;
        }
        if (size == 0) {
            finish(s);
            return;
        }
        size_t data = (size_t)(line_end - buf) + 2;
        if (s->len < data + size + 2)
            break;
        on_chunk(s, buf + data, size, now);
        pos = data + size + 2;
    }
    memmove(buf, buf + pos, s->len - pos);
    s->len -= pos;
}

/* Read the socket until it is drained, then parse; EOF before the end is the stream's
 * error. A read shorter than the room it was given drained the socket: the EAGAIN read
 * that would follow is skipped (epoll is level-triggered, so data that comes later is
 * reported again). */
static void on_readable(struct stream *s, double now) {
    int err = 0, is_eof = 0;
    for (;;) {
        if (s->cap - s->len < READ_SPACE) {
            s->cap = s->cap ? 2 * s->cap : 2 * READ_SPACE;
            s->buf = xrealloc(s->buf, s->cap);
        }
        size_t space = s->cap - s->len;
        ssize_t r = read(s->fd, s->buf + s->len, space);
        if (r > 0) {
            if (!s->first_byte_at)
                s->first_byte_at = now;
            s->len += (size_t)r;
            if ((size_t)r < space)
                break; /* drained */
        } else if (r == 0) {
            is_eof = 1;
            break;
        } else if (errno == EINTR) {
            continue;
        } else {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                err = errno;
            break;
        }
    }
    parse(s, now);
    if (s->is_done || !(is_eof || err))
        return;
    if (err)
        add_error("read: connection lost before the end (%s)", strerror(err));
    else
        add_error("read: connection lost before the end");
    finish(s);
}

/* Write what is left of the request; once it is all out, wait for the response only. */
static void send_request(struct stream *s) {
    while (s->req_sent < s->req_len) {
        ssize_t r = send(s->fd, s->req + s->req_sent, s->req_len - s->req_sent, MSG_NOSIGNAL);
        if (r >= 0) {
            s->req_sent += (size_t)r;
        } else if (errno == EINTR) {
            continue;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return; /* EPOLLOUT again when there is room */
        } else {
            add_error("read: connection lost before the end (write: %s)", strerror(errno));
            finish(s);
            return;
        }
    }
    free(s->req);
    s->req = NULL;
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)(s - streams)};
    if (epoll_ctl(epfd, EPOLL_CTL_MOD, s->fd, &ev) < 0)
        die("epoll_ctl");
}

/* The request bytes of stream k, exactly as one_stream builds them. */
static void build_request(struct stream *s, long prompt_id, long max_tokens) {
    char body[256], head[256];
    int body_len = snprintf(body, sizeof body,
                            "{\"prompt\": [%ld], \"max_tokens\": %ld, \"stream\": true, "
                            "\"ignore_eos\": true, \"temperature\": 0, "
                            "\"stream_options\": {\"include_usage\": true}}",
                            prompt_id, max_tokens);
    int head_len = snprintf(head, sizeof head,
                            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                            "Connection: close\r\nContent-Type: application/json\r\n"
                            "Content-Length: %d\r\n\r\n",
                            body_len);
    s->req_len = (size_t)head_len + (size_t)body_len;
    s->req = xrealloc(NULL, s->req_len);
    memcpy(s->req, head, (size_t)head_len);
    memcpy(s->req + head_len, body, (size_t)body_len);
}

/* Start stream k's non-blocking connect; EPOLLOUT tells when it is done. */
static void start_connect(int k, const struct sockaddr_in *addr) {
    struct stream *s = &streams[k];
    s->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s->fd < 0) {
        add_error("connect: %s", strerror(errno));
        finish(s);
        return;
    }
    if (connect(s->fd, (const struct sockaddr *)addr, sizeof *addr) < 0 && errno != EINPROGRESS) {
        add_error("connect: %s", strerror(errno));
        finish(s);
        return;
    }
    struct epoll_event ev = {.events = EPOLLOUT | EPOLLIN, .data.u32 = (uint32_t)k};
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, s->fd, &ev) < 0)
        die("epoll_ctl");
}

/* One epoll event of stream k. */
static void on_event_of(struct stream *s, uint32_t events, double now) {
    if (s->is_done)
        return;
    if (!s->is_connected) {
        int err = 0;
        socklen_t err_len = sizeof err;
        if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &err_len) < 0)
            err = errno;
        if (!err && !(events & EPOLLOUT))
            err = ECONNABORTED; /* hung up without saying why */
        if (err) {
            add_error("connect: %s", strerror(err));
            finish(s);
            return;
        }
        s->is_connected = 1;
        s->connected_at = now;
        struct sockaddr_in local;
        socklen_t local_len = sizeof local;
        if (getsockname(s->fd, (struct sockaddr *)&local, &local_len) == 0)
            s->port = ntohs(local.sin_port);
    }
    if (s->req && (events & EPOLLOUT)) {
        send_request(s);
        if (s->is_done)
            return;
        if (!s->req)
            s->sent_at = now;
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR))
        on_readable(s, now);
}

/* Let this process hold one socket per stream (and some more). */
static void raise_nofile(int needed) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < (rlim_t)needed) {
        rl.rlim_cur = rl.rlim_max < (rlim_t)needed ? rl.rlim_max : (rlim_t)needed;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* A string as a JSON string: quotes, backslashes and control characters escaped. */
static void write_json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void write_result(const char *path, double start, double end) {
    FILE *f = fopen(path, "w");
    if (!f)
        die(path);
    fprintf(f, "{\"start\": %.6f, \"end\": %.6f, \"usage\": [", start, end);
    for (int k = 0; k < num_streams; k++)
        fprintf(f, k ? ", %ld" : "%ld", streams[k].usage);
    fputs("], \"errors\": [", f);
    for (size_t i = 0; i < num_errors; i++) {
        if (i)
            fputs(", ", f);
        write_json_string(f, errors[i]);
    }
    fputs("], \"ramp\": [", f);
    for (int k = 0; k < num_streams; k++)
        fprintf(f, "%s[%.6f, %.6f, %.6f, %d]", k ? ",\n" : "\n", streams[k].connected_at,
                streams[k].sent_at, streams[k].first_byte_at, streams[k].port);
    fputs("], \"arrivals\": [", f);
    for (int k = 0; k < num_streams; k++) {
        fputs(k ? ",\n[" : "\n[", f);
        for (size_t i = 0; i < streams[k].num_times; i++)
            fprintf(f, i ? ", %.6f" : "%.6f", streams[k].times[i]);
        fputc(']', f);
    }
    fputs("]}\n", f);
    if (fclose(f) != 0)
        die(path);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s PORT NUM_STREAMS MAX_TOKENS PROMPT_BASE_ID OUT_JSON\n",
                argv[0]);
        return 2;
    }
    int port = atoi(argv[1]);
    num_streams = atoi(argv[2]);
    long max_tokens = atol(argv[3]), prompt_base_id = atol(argv[4]);
    const char *out_path = argv[5];
    if (port <= 0 || port > 65535 || num_streams < 0) {
        fprintf(stderr, "relay_client: bad port or number of streams\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    raise_nofile(num_streams + 64);

    streams = xrealloc(NULL, (size_t)num_streams * sizeof *streams);
    memset(streams, 0, (size_t)num_streams * sizeof *streams);
    for (int k = 0; k < num_streams; k++) {
        streams[k].fd = -1;
        build_request(&streams[k], prompt_base_id + k, max_tokens);
    }
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        die("epoll_create1");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);

    double start = now_s();
    num_open = num_streams;
    for (int k = 0; k < num_streams; k++)
        start_connect(k, &addr);

    struct epoll_event events[MAX_EVENTS];
    double last_progress = start;
    while (num_open > 0) {
        int n = epoll_wait(epfd, events, MAX_EVENTS, 1000);
        if (n < 0 && errno != EINTR)
            die("epoll_wait");
        double now = now_s();
        if (n <= 0) {
            if (now - last_progress > STALL_TIMEOUT_S) {
                for (int k = 0; k < num_streams; k++) {
                    if (!streams[k].is_done) {
                        add_error("timeout: no progress for %.0f s", STALL_TIMEOUT_S);
                        finish(&streams[k]);
                    }
                }
            }
            continue;
        }
        last_progress = now;
        for (int i = 0; i < n; i++)
            on_event_of(&streams[events[i].data.u32], events[i].events, now);
        /* Paced: the next epoll_wait returns POLL_INTERVAL_S after this one at the
         * soonest, so that each wakeup serves a batch of sockets (see the header). */
        if (n < MAX_EVENTS) {
            double left = now + POLL_INTERVAL_S - now_s();
            if (left > 0) {
                struct timespec ts = {0, (long)(left * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
    }
    double end = now_s();
    close(epfd);
    write_result(out_path, start, end);
    return 0;
}
