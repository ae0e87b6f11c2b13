/* nfq_delay: delays every packet of an NFQUEUE queue by a fixed time, for kernels without
 * sch_netem (tests/multihost/bed.sh's bed_delay runs it inside a host's network namespace).
 *
 *   nfq_delay [-q QUEUE] [-m MAXLEN] [-r] DELAY_MS
 *   iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num QUEUE --queue-bypass
 *
 * Each packet the kernel queues is given its ACCEPT verdict DELAY_MS (decimals allowed) after it
 * reached this program: a FIFO holds the packet ids and their release times, a timerfd fires at
 * the head's, and the verdicts go out in arrival order while later packets keep arriving. Only
 * the packets' metadata is copied (NFQNL_COPY_META), and GSO packets are queued whole
 * (NFQA_CFG_F_GSO), so a 64 KiB TCP segment costs one verdict. -q: the queue number (default 0);
 * -m: the kernel's queue length (default 65536 packets; beyond it the kernel drops); -r: run as
 * SCHED_FIFO (priority 10), so that busy CPUs do not add to the delay.
 *
 * It prints "nfq_delay: ready ..." on stdout once the queue is bound (add the iptables rule after
 * that line: without --queue-bypass, packets of a queue nobody listens to are dropped). SIGTERM or
 * SIGINT: the packets still held are accepted at once, the queue is unbound, statistics go to
 * stdout (packets, the most held at once, how late the verdicts were) and it exits 0.
 */
#define _GNU_SOURCE
#include <arpa/inet.h> /* ntohl */
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h> /* NF_ACCEPT */
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

struct held {
  uint32_t id;
  int64_t due_ns;
};

static struct {
  struct held* ring;
  size_t cap, head, len; /* cap: a power of two */
  int64_t delay_ns;
  uint64_t packets, max_len, late_sum_ns, verdict_errors;
  int64_t late_max_ns;
  struct nfq_q_handle* qh;
} g;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void push(uint32_t id, int64_t due_ns) {
  if (g.len == g.cap) { /* grow: the kernel's maxlen bounds this, but never lose an id */
    size_t cap = g.cap * 2;
    struct held* ring = malloc(cap * sizeof *ring);
    if (!ring) {
      perror("nfq_delay: malloc");
      exit(1);
    }
    for (size_t i = 0; i < g.len; i++) ring[i] = g.ring[(g.head + i) & (g.cap - 1)];
    free(g.ring);
    g.ring = ring, g.cap = cap, g.head = 0;
  }
  g.ring[(g.head + g.len) & (g.cap - 1)] = (struct held){id, due_ns};
  g.len++;
  if (g.len > g.max_len) g.max_len = g.len;
}

/* Accepts every held packet due by `until` (all of them with INT64_MAX). */
static void release(int64_t until) {
  int64_t now = now_ns();
  while (g.len > 0) {
    struct held* h = &g.ring[g.head];
    if (h->due_ns > until) break;
    if (nfq_set_verdict(g.qh, h->id, NF_ACCEPT, 0, NULL) < 0) g.verdict_errors++;
    int64_t late = now - h->due_ns;
    if (late > 0 && until != INT64_MAX) {
      g.late_sum_ns += (uint64_t)late;
      if (late > g.late_max_ns) g.late_max_ns = late;
    }
    g.head = (g.head + 1) & (g.cap - 1);
    g.len--;
  }
}

static int on_packet(struct nfq_q_handle* qh, struct nfgenmsg* msg, struct nfq_data* nfa,
                     void* data) {
  (void)qh, (void)msg, (void)data;
  struct nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(nfa);
  if (!ph) return 0;
  push(ntohl(ph->packet_id), now_ns() + g.delay_ns);
  g.packets++;
  return 0;
}

static void usage(void) {
  fprintf(stderr, "usage: nfq_delay [-q QUEUE] [-m MAXLEN] [-r] DELAY_MS\n");
  exit(2);
}

int main(int argc, char** argv) {
  unsigned queue = 0, maxlen = 65536;
  int rt = 0, opt;
  while ((opt = getopt(argc, argv, "q:m:rh")) != -1) {
    switch (opt) {
      case 'q':
        queue = (unsigned)strtoul(optarg, NULL, 10);
        break;
      case 'm':
        maxlen = (unsigned)strtoul(optarg, NULL, 10);
        break;
      case 'r':
        rt = 1;
        break;
      default:
        usage();
    }
  }
  if (optind != argc - 1) usage();
  char* end;
  double delay_ms = strtod(argv[optind], &end);
  if (*end || end == argv[optind] || delay_ms < 0 || delay_ms > 600000) usage();
  g.delay_ns = (int64_t)(delay_ms * 1e6);
  g.cap = 1024;
  while (g.cap < maxlen) g.cap *= 2;
  g.ring = malloc(g.cap * sizeof *g.ring);
  if (!g.ring) return 1;

  if (rt) {
    struct sched_param sp = {.sched_priority = 10};
    if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0)
      fprintf(stderr, "nfq_delay: SCHED_FIFO: %s (going on without)\n", strerror(errno));
  }

  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  sigprocmask(SIG_BLOCK, &sigs, NULL);
  int sfd = signalfd(-1, &sigs, SFD_CLOEXEC);
  int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (sfd < 0 || tfd < 0) {
    perror("nfq_delay: signalfd/timerfd");
    return 1;
  }

  struct nfq_handle* h = nfq_open();
  if (!h) {
    perror("nfq_delay: nfq_open");
    return 1;
  }
  g.qh = nfq_create_queue(h, (uint16_t)queue, on_packet, NULL);
  if (!g.qh) {
    fprintf(stderr, "nfq_delay: cannot bind queue %u: %s (root? queue taken?)\n", queue,
            strerror(errno));
    nfq_close(h);
    return 1;
  }
  if (nfq_set_mode(g.qh, NFQNL_COPY_META, 0) < 0) {
    /* Kernels before 3.x know no COPY_META: copy the first bytes instead. */
    if (nfq_set_mode(g.qh, NFQNL_COPY_PACKET, 64) < 0) {
      perror("nfq_delay: nfq_set_mode");
      return 1;
    }
  }
  if (nfq_set_queue_maxlen(g.qh, maxlen) < 0) perror("nfq_delay: nfq_set_queue_maxlen");
  if (nfq_set_queue_flags(g.qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO) < 0)
    fprintf(stderr, "nfq_delay: no NFQA_CFG_F_GSO: GSO packets are segmented before queueing\n");
  /* Room for a burst of queued packets' messages: a lost message is a packet held forever. */
  nfnl_rcvbufsiz(nfq_nfnlh(h), 16 << 20);
  int fd = nfq_fd(h);
  int one = 1;
  setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);

  printf("nfq_delay: ready, queue %u, delay %.3f ms, maxlen %u%s\n", queue, delay_ms, maxlen,
         rt ? ", SCHED_FIFO" : "");
  fflush(stdout);

  static char buf[1 << 16] __attribute__((aligned));
  struct pollfd pfd[3] = {{fd, POLLIN, 0}, {tfd, POLLIN, 0}, {sfd, POLLIN, 0}};
  int armed_for_empty = 1;
  for (;;) {
    release(now_ns());
    struct itimerspec its = {0};
    if (g.len > 0) {
      int64_t due = g.ring[g.head].due_ns;
      its.it_value.tv_sec = due / 1000000000;
      its.it_value.tv_nsec = due % 1000000000;
      timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL);
      armed_for_empty = 0;
    } else if (!armed_for_empty) {
      timerfd_settime(tfd, 0, &its, NULL); /* disarm */
      armed_for_empty = 1;
    }
    if (poll(pfd, 3, -1) < 0) {
      if (errno == EINTR) continue;
      perror("nfq_delay: poll");
      break;
    }
    if (pfd[2].revents) break;
    if (pfd[1].revents) {
      uint64_t n;
      if (read(tfd, &n, sizeof n) < 0 && errno != EAGAIN) perror("nfq_delay: timerfd");
    }
    if (pfd[0].revents) {
      for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
          if (errno == ENOBUFS) continue;
          perror("nfq_delay: recv");
          goto out;
        }
        nfq_handle_packet(h, buf, (int)n);
      }
    }
  }
out:
  release(INT64_MAX);
  nfq_destroy_queue(g.qh);
  nfq_close(h);
  printf(
      "nfq_delay: stopped; %llu packets, at most %llu held, verdicts late by %.3f ms on "
      "average and %.3f ms at most, %llu verdict errors\n",
      (unsigned long long)g.packets, (unsigned long long)g.max_len,
      g.packets ? (double)g.late_sum_ns / (double)g.packets / 1e6 : 0.0,
      (double)g.late_max_ns / 1e6, (unsigned long long)g.verdict_errors);
  fflush(stdout);
  return 0;
}
